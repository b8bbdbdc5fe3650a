"""Cache pack/restore throughput: hgxserve's archive vs GNU `tar --zstd`, same tree, same run.

A cache-like tree (many small kernels, some large compiled blobs, half compressible) is packed
and restored by both, alternating, 3 rounds; the best round of each is printed. Ours also
hashes every file (manifest) and verifies every checksum on restore; tar does neither.

    .venv/bin/python benchmarks/bench_cache_pack.py --mib 256
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hgxserve.caches.archive import pack_dir, restore_archive  # noqa: E402


def make_tree(root: str, mib: int) -> int:
    rng = random.Random(7)
    total = 0
    target = mib << 20
    i = 0
    while total < target:
        big = i % 10 == 0
        size = rng.randint(4 << 20, 16 << 20) if big else rng.randint(2 << 10, 200 << 10)
        half = size // 2
        data = os.urandom(half) + bytes(rng.getrandbits(8) % 4 for _ in range(64)) * (
            (size - half) // 64
        )
        sub = ("triton", "inductor", "deep_gemm", "vllm/torch_compile_cache")[i % 4]
        path = os.path.join(root, sub, f"d{i % 37}", f"k{i}.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
        total += len(data)
        i += 1
    return total


def timed(fn) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-cache-")
    try:
        src = os.path.join(work, "root", "key")
        total = make_tree(src, args.mib)
        files = sum(len(n) for _, _, n in os.walk(src))
        best: dict[str, float] = {}
        sizes: dict[str, int] = {}
        for r in range(args.rounds):
            out = os.path.join(work, f"ours{r}")
            res = None

            def ours_pack(out: str = out) -> None:
                nonlocal res
                res = pack_dir(src, out + "/")

            t = timed(ours_pack)
            best["ours pack"] = min(best.get("ours pack", 1e9), t)
            assert res is not None
            sizes["ours"] = res.archive_bytes
            dest = os.path.join(work, f"restore{r}", "key")
            t = timed(lambda res=res, dest=dest: restore_archive(res.path, dest))
            best["ours restore"] = min(best.get("ours restore", 1e9), t)
            shutil.rmtree(os.path.dirname(dest))
            shutil.rmtree(out)

            tar_out = os.path.join(work, f"tar{r}.tar.zst")
            t = timed(
                lambda tar_out=tar_out: subprocess.run(
                    ["tar", "--zstd", "-cf", tar_out, "-C", src, "."], check=True
                )
            )
            best["tar --zstd pack"] = min(best.get("tar --zstd pack", 1e9), t)
            sizes["tar"] = os.path.getsize(tar_out)
            tdest = os.path.join(work, f"tarx{r}")
            os.makedirs(tdest)
            t = timed(
                lambda tar_out=tar_out, tdest=tdest: subprocess.run(
                    ["tar", "--zstd", "-xf", tar_out, "-C", tdest], check=True
                )
            )
            best["tar --zstd restore"] = min(best.get("tar --zstd restore", 1e9), t)
            shutil.rmtree(tdest)
            os.unlink(tar_out)
        mib = total / (1 << 20)
        print(f"tree: {files} files, {mib:.0f} MiB; best of {args.rounds} rounds")
        print(
            f"archive size: ours {sizes['ours'] / (1 << 20):.1f} MiB, "
            f"tar --zstd {sizes['tar'] / (1 << 20):.1f} MiB"
        )
        for name, seconds in best.items():
            print(f"  {name:20s} {seconds:6.2f} s  {mib / seconds:7.1f} MiB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
