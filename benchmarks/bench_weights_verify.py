"""Benchmark: `hgxserve weights verify` (parallel across files) vs `sha256sum` and
`openssl dgst -sha256` over the same tree, and the state-skip re-verify vs a full rehash.

The tree is the one bench_weights_sync.py builds (4 x 256 MiB + 200 x 64 KiB, with a manifest);
it is read from the page cache in every run (warmed once first), so this measures hashing work.

    .venv/bin/python benchmarks/bench_weights_verify.py --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def run(cmd: list[str] | str, shell: bool = False) -> float:
    start = time.monotonic()
    proc = subprocess.run(cmd, shell=shell, capture_output=True, text=True)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr[-1000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", default="/tmp/hgxserve-bench-sync/served/bench/model")
    args = parser.parse_args()
    tree = Path(args.tree)
    if not (tree / "hgxserve-manifest.json").exists():
        subprocess.run(
            [sys.executable, str(Path(__file__).parent / "bench_weights_sync.py"), "--rounds", "0"],
            check=True,
        )
    files = sorted(str(p) for p in tree.rglob("*") if p.is_file() and not p.name.startswith("."))
    files = [f for f in files if not f.endswith("hgxserve-manifest.json")]
    total = sum(Path(f).stat().st_size for f in files) / 2**20
    state = Path("/tmp/hgxserve-bench-verify-state")
    hgx = [str(BIN / "hgxserve"), "weights", "verify", str(tree), "--state-dir", str(state), "-q"]
    listing = " ".join(files)
    tools = {
        "hgxserve verify --full": lambda: run([*hgx, "--full"]),
        "sha256sum": lambda: run(f"sha256sum {listing} > /dev/null", shell=True),
        "openssl dgst -sha256": lambda: run(
            f"openssl dgst -sha256 {listing} > /dev/null", shell=True
        ),
        "sha256sum x2 (xargs -P2)": lambda: run(
            f"printf '%s\\n' {listing} | xargs -P2 -n 50 sha256sum > /dev/null", shell=True
        ),
    }
    shutil.rmtree(state, ignore_errors=True)
    run(f"cat {listing} > /dev/null", shell=True)  # warm the page cache once for everyone
    times: dict[str, list[float]] = {n: [] for n in tools}
    names = list(tools)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(tools[name]())
    run([*hgx, "--full"])
    skip = [run(hgx) for _ in range(args.rounds)]
    print(f"tree: {total:.0f} MiB in {len(files)} files; {args.rounds} rounds, alternating")
    print(f"{'tool':26s} {'median s':>9s} {'MiB/s':>8s}")
    for name in sorted(names, key=lambda n: statistics.median(times[n])):
        med = statistics.median(times[name])
        print(f"{name:26s} {med:9.2f} {total / med:8.1f}")
    print(
        f"{'hgxserve verify (state)':26s} {statistics.median(skip):9.2f}        -   "
        "(unchanged files: one stat each, no hashing)"
    )
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
