"""Benchmark: `hgxserve weights sync` vs `aws s3 sync` vs `s5cmd sync` vs the boto3 transfer
manager, against the same local `rclone serve s3`, on the same files, alternating order.

The tree is 4 x 256 MiB shards + 200 small files (64 KiB) with a published hgxserve manifest, so
our sync also checks every byte against a sha256 while the others only copy. Before every timed
run the destination is deleted, synced to disk and left for a few seconds, because this VM charges
the next writer for reclaiming freed pages. No-op re-sync times are measured on a complete copy.

    .venv/bin/python benchmarks/bench_weights_sync.py --rounds 3

To compare with an earlier version of hgxserve in the same run (same server, same protocol):

    mkdir /tmp/base && git archive <rev> hgxserve files schemas | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_weights_sync.py --rounds 5 --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchlib import baseline_command, free_port

BIN = Path(sys.executable).parent
ACCESS, SECRET = "BENCHACCESSKEY", "bench-secret-key-0000"
BUCKET, PREFIX = "bench", "model/"


def make_tree(root: Path, shards: int, shard_mib: int, small: int) -> int:
    model = root / BUCKET / PREFIX
    stamp = model / f".tree-v2-{shards}x{shard_mib}-{small}"
    if not stamp.exists():
        shutil.rmtree(root, ignore_errors=True)
        model.mkdir(parents=True)
        for i in range(shards):
            with open(model / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
                for _ in range(shard_mib):
                    fh.write(os.urandom(1 << 20))
        # a whole checkpoint (config, tokenizer, indexed shards): sync marks only those verified
        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        (model / "config.json").write_text('{"architectures": ["BenchForCausalLM"]}\n')
        (model / "tokenizer.json").write_bytes(os.urandom(64 << 10))
        index = {"weight_map": {f"layer.{i}": name for i, name in enumerate(names)}}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
        for i in range(small):
            (model / "extra").mkdir(exist_ok=True)
            (model / "extra" / f"small-{i:03d}.bin").write_bytes(os.urandom(64 << 10))
        subprocess.run(
            [str(BIN / "hgxserve"), "weights", "manifest", str(model), "--publish"],
            check=True,
            capture_output=True,
        )
        stamp.write_text("")
    return sum(p.stat().st_size for p in model.rglob("*") if p.is_file() and p != stamp)


def start_rclone(root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, RCLONE_CONFIG="/dev/null")
    proc = subprocess.Popen(
        [
            str(BIN / "rclone"),
            "serve",
            "s3",
            str(root),
            "--addr",
            f"127.0.0.1:{port}",
            "--auth-key",
            f"{ACCESS},{SECRET}",
            "--log-level",
            "ERROR",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            time.sleep(0.1)
    return proc, url


# Runs the hgxserve CLI from another source tree: that tree first on sys.path, and the editable
# install's finder (which maps `hgxserve` to this checkout) left out.
def tool_commands(
    url: str, dest: Path, cfg: Path, baseline: str | None = None
) -> dict[str, list[str]]:
    src = f"s3://{BUCKET}/{PREFIX}"
    ours = [
        "weights",
        "sync",
        src,
        str(dest),
        "--endpoint-url",
        url,
        "--addressing",
        "path",
        "--concurrency",
        "16",
        "--part-size",
        "8MiB",
        "-q",
    ]
    extra = {}
    if baseline:
        base = baseline_command(baseline)
        extra = {"hgxserve@baseline": base + ours}
    return extra | {
        "hgxserve": [
            str(BIN / "hgxserve"),
            "weights",
            "sync",
            src,
            str(dest),
            "--endpoint-url",
            url,
            "--addressing",
            "path",
            "--concurrency",
            "16",
            "--part-size",
            "8MiB",
            "-q",
        ],
        "hgxserve --no-fsync": [
            str(BIN / "hgxserve"),
            "weights",
            "sync",
            src,
            str(dest),
            "--endpoint-url",
            url,
            "--addressing",
            "path",
            "--concurrency",
            "16",
            "--part-size",
            "8MiB",
            "-q",
            "--no-fsync",
        ],
        "aws s3 sync": [
            str(BIN / "aws"),
            "--endpoint-url",
            url,
            "s3",
            "sync",
            src,
            str(dest),
            "--only-show-errors",
        ],
        "s5cmd sync": [
            str(BIN / "s5cmd"),
            "--endpoint-url",
            url,
            "sync",
            f"{src}*",
            str(dest) + "/",
        ],
        "boto3 transfer": [sys.executable, __file__, "--boto3-download", url, str(dest)],
    }


def boto3_download(url: str, dest: str) -> None:
    """The boto3 transfer manager, 32 threads per file, all files at once."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
        for o in page.get("Contents", [])
    ]
    config = TransferConfig(max_concurrency=32, multipart_chunksize=32 << 20)

    def one(key: str) -> None:
        path = os.path.join(dest, key[len(PREFIX) :])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        client.download_file(BUCKET, key, path, Config=config)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, keys))


def settle(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()
    time.sleep(3)


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--work", default="/tmp/hgxserve-bench-sync")
    parser.add_argument("--tools", default="")
    parser.add_argument(
        "--baseline-tree", help="also run hgxserve from this source tree (an earlier revision)"
    )
    parser.add_argument("--boto3-download", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.boto3_download:
        boto3_download(*args.boto3_download)
        return
    work = Path(args.work)
    served = work / "served"
    total = make_tree(served, args.shards, args.shard_mib, args.small)
    dest = work / "dest"
    cfg = work / "aws-config"
    cfg.write_text("[default]\nregion = us-east-1\ns3 =\n  max_concurrent_requests = 32\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(cfg),
        AWS_SHARED_CREDENTIALS_FILE=str(work / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    proc, url = start_rclone(served)
    try:
        tools = tool_commands(url, dest, cfg, args.baseline_tree)
        if args.tools:
            tools = {k: v for k, v in tools.items() if k in args.tools.split(",")}
        names = list(tools)
        full: dict[str, list[float]] = {n: [] for n in names}
        noop: dict[str, list[float]] = {n: [] for n in names}
        print(
            f"tree: {total / 2**20:.0f} MiB ({args.shards} x {args.shard_mib} MiB + "
            f"{args.small} x 64 KiB) on rclone serve s3 {url}; {os.cpu_count()} CPUs",
            flush=True,
        )
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                settle(dest)
                took = timed(tools[name], env)
                full[name].append(took)
                noop[name].append(timed(tools[name], env))
                print(
                    f"  round {r + 1} {name:22s} {took:6.2f}s {total / 2**20 / took:7.1f} MiB/s"
                    f"  no-op {noop[name][-1]:.2f}s",
                    flush=True,
                )
        print()
        print(f"{'tool':22s} {'median s':>9s} {'MiB/s':>8s} {'best MiB/s':>11s} {'no-op s':>8s}")
        for name in sorted(names, key=lambda n: statistics.median(full[n])):
            med = statistics.median(full[name])
            print(
                f"{name:22s} {med:9.2f} {total / 2**20 / med:8.1f} "
                f"{total / 2**20 / min(full[name]):11.1f} {statistics.median(noop[name]):8.2f}"
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()
