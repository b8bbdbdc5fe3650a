"""No-op re-apply of a release on the 3 local test hosts, against pyinfra's own floor.

Brings the test hosts up (reusing running ones), deploys the demo baseline once (weights +
engines), then times N no-op re-applies of `deploys/engines.py` and of `deploys/site.py
--data stages=runtime,weights,engines`, next to the floor of any pyinfra run on the same hosts
(`pyinfra inventory/testhosts.py exec -- true`: connect, one command, disconnect), alternating
rounds. Needs root. Prints a table; asserts nothing about the time.

    .venv/bin/python benchmarks/bench_reapply.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed import demo  # noqa: E402
from testbed import hosts as testbed_hosts  # noqa: E402

TOPOLOGY = "topologies/demo/demo-baseline.yml"
PYINFRA = [str(REPO / ".venv/bin/pyinfra"), "-y", "inventory/testhosts.py"]


def timed(args: list[str]) -> float:
    started = time.monotonic()
    proc = subprocess.run([*PYINFRA, *args], cwd=REPO, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"pyinfra {' '.join(args)} failed:\n{text[-3000:]}")
    if args[0].startswith("deploys/"):
        total = [line for line in text.splitlines() if "Grand total" in line][0]
        if total.split()[3] != "-":  # Grand total N success error nochange
            raise SystemExit(f"not a no-op run: {total.strip()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    bed = testbed_hosts.up(3, "h200")
    with tempfile.TemporaryDirectory() as work:
        demo.prepare(bed.names, Path(work))
    try:
        site = [
            "deploys/site.py",
            "--data",
            f"topology={TOPOLOGY}",
            "--data",
            "stages=runtime,weights,engines",
        ]
        subprocess.run([*PYINFRA, *site], cwd=REPO, check=True, capture_output=True)
        cases = {
            "pyinfra floor (exec -- true)": ["exec", "--", "true"],
            "hgxserve engines.py re-apply": [
                "deploys/engines.py",
                "--data",
                f"topology={TOPOLOGY}",
            ],
            "hgxserve site.py runtime,weights,engines": site,
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, case in cases.items():
                times[name].append(timed(case))
        print(f"\nno-op re-apply on {len(bed.names)} test hosts, {args.rounds} alternating rounds")
        print(f"{'run':38} {'median s':>9} {'min s':>7} {'max s':>7}")
        for name, values in times.items():
            print(
                f"{name:38} {statistics.median(values):9.2f} {min(values):7.2f} {max(values):7.2f}"
            )
    finally:
        demo.stop_s3()


if __name__ == "__main__":
    main()
