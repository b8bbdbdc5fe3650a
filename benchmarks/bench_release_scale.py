"""Release time against the number of test hosts: how the control plane scales.

For each host count (default 3, 6, 9) it boots that many test hosts (`testbed up --hosts N`),
renders a topology with one combined engine (TP2, simulated, ready in 2 s) per host and the proxy
on the first host, and times, with the real pyinfra CLI:

- fresh:  `deploys/site.py --data stages=runtime,weights,engines` on hosts that never ran a
          release (agent install, the simulated engine's wheels, weights sync from the local S3,
          stage, switch, warm-up, gate, confirm);
- no-op:  the same command again (0 changes, nothing restarted);
- switch: a topology whose engines all changed (every host stops and starts its engine);

next to the floor of any pyinfra run on the same hosts (`pyinfra exec -- true`: connect, one
command, disconnect). Needs root and the e2e lock (it uses the shared test hosts):

    flock /tmp/hgxserve-e2e.lock .venv/bin/python benchmarks/bench_release_scale.py [--hosts 3,6,9]

Prints a table; asserts nothing about the time. The hosts are left down afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed import demo  # noqa: E402
from testbed import hosts as testbed_hosts  # noqa: E402
from testbed.simaccept import accept_simulation_env  # noqa: E402

PYINFRA = [str(REPO / ".venv/bin/pyinfra"), "-y", "inventory/testhosts.py"]


def topology(names: list[str], addresses: dict[str, str], marker: str) -> str:
    """One combined TP2 engine per host, the proxy on the first host; `marker` (an engine env
    value) changes every engine when it changes."""
    hosts = "\n".join(f"  {n}: {{address: {addresses[n]}, gpu: H200, gpus: 8}}" for n in names)
    engines = "\n".join(
        f"  combined-{i}:\n    role: combined\n    place: {{{n}: [0, 1]}}\n    tp: 2\n"
        f"    port: 8100\n    env: {{HGXSERVE_SIM_BENCH_MARKER: {marker}}}"
        for i, n in enumerate(names)
    )
    combined = ", ".join(f"combined-{i}" for i in range(len(names)))
    return accept_simulation_env(f"""name: bench-scale-{len(names)}
hosts:
{hosts}
model:
  name: tiny
  served_name: tiny
  path: /models/tiny
  source:
    s3:
      endpoint: {demo.S3_ENDPOINT}
      bucket: {demo.BUCKET}
      prefix: {demo.PREFIX}
      addressing: path
      credentials: {{env_file: /etc/hgxserve/s3.env}}
defaults:
  engine: vllm
  version: 0.26.0
  runtime: {{venv: /opt/vllm-sim}}
  args: {{max_model_len: 256, max_num_seqs: 8, block_size: 16}}
engines:
{engines}
proxy:
  host: {names[0]}
  listen: 0.0.0.0:8000
  combined: [{combined}]
""")


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def changed_operations(text: str) -> list[str]:
    """`host: operation` for every operation pyinfra reported as changed (Success) in a run.

    >>> changed_operations("--> Starting operation: Stage x\\n    [hgx-a] Success\\n")
    ['hgx-a: Stage x']
    """
    out, operation = [], "?"
    for line in ANSI.sub("", text).splitlines():
        started = re.search(r"--> Starting (?:[\w ,]+ )?operation: (.*)", line)
        if started:
            operation = started.group(1).strip()
        done = re.match(r"\s*\[([^\]]+)\] Success", line)
        if done:
            out.append(f"{done.group(1)}: {operation}")
    return out


def timed(args: list[str], expect_noop: bool = False, log: Path | None = None) -> float:
    started = time.monotonic()
    proc = subprocess.run([*PYINFRA, *args], cwd=REPO, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    text = proc.stdout + proc.stderr
    if log is not None:
        log.write_text(text)
    if proc.returncode != 0:
        raise SystemExit(f"pyinfra {' '.join(args)} failed:\n{text[-3000:]}")
    if expect_noop:
        match = re.search(r"Grand total\s+\S+\s+(\S+)\s+(\S+)", text)
        if not match or match.groups() != ("-", "-"):
            changed = "\n  ".join(changed_operations(text)) or text[-2000:]
            raise SystemExit(f"not a no-op run ({match.group(0) if match else ''}):\n  {changed}")
    return elapsed


UNITS = (
    "systemctl list-units 'hgxserve-*' --all --no-legend --plain | grep -v reconcile; "
    "for u in $(systemctl list-units 'hgxserve-*' --all --no-legend --plain "
    "| awk '$3 != \"active\" {print $1}'); do journalctl -u $u -n 8 --no-pager -o cat; done"
)


def unit_states(bed: testbed_hosts.Testbed) -> str:
    """Every host's hgxserve units, and the last journal lines of those not active."""
    return "\n".join(f"{n}:\n{bed.ssh(n, UNITS).stdout.rstrip()}" for n in bed.names)


def measure(count: int, work: Path, logs: Path | None) -> dict[str, float]:
    bed = testbed_hosts.up(count, "h200")
    for name in bed.names:
        bed.ssh(name, demo.FORGET_RELEASES, check=True)
    demo.prepare(bed.names, work / f"demo-{count}")
    first, second = work / f"a-{count}.yml", work / f"b-{count}.yml"
    first.write_text(topology(bed.names, bed.addresses, "a"))
    second.write_text(topology(bed.names, bed.addresses, "b"))
    site = ["deploys/site.py", "--data", "stages=runtime,weights,engines"]

    def log(step: str) -> Path | None:
        return logs / f"{count}-{step}.log" if logs else None

    out = {"pyinfra floor": timed(["exec", "--", "true"])}
    out["fresh"] = timed([*site, "--data", f"topology={first}"], log=log("fresh"))
    print(f"{count} hosts: fresh {out['fresh']:.1f} s", flush=True)
    try:
        out["no-op"] = timed(
            [*site, "--data", f"topology={first}"], expect_noop=True, log=log("no-op")
        )
    except SystemExit:
        print(unit_states(bed), flush=True)  # why a host switched again
        raise
    out["switch"] = timed(["deploys/engines.py", "--data", f"topology={second}"], log=log("switch"))
    print(f"{count} hosts: {out}", flush=True)
    for name in bed.names:
        bed.ssh(name, demo.FORGET_RELEASES)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", default="3,6,9", help="host counts, comma-separated")
    parser.add_argument("--logs", type=Path, help="keep each pyinfra run's output here")
    args = parser.parse_args()
    counts = [int(c) for c in args.hosts.split(",")]
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict[str, float]] = {}
    # a lease, as a pytest session holds: no other session replaces the hosts mid-measurement
    testbed_hosts.take_lease(os.getpid())
    try:
        with tempfile.TemporaryDirectory() as work:
            for count in counts:
                results[count] = measure(count, Path(work), args.logs)
    finally:
        demo.stop_s3()
        if not testbed_hosts.drop_lease(os.getpid()):
            testbed_hosts.down()
    cases = ["pyinfra floor", "fresh", "no-op", "switch"]
    print("\nrelease time (s) against the number of test hosts (one engine per host)")
    print(f"{'hosts':>5} " + " ".join(f"{c:>14}" for c in cases))
    for count, row in results.items():
        print(f"{count:>5} " + " ".join(f"{row[c]:14.1f}" for c in cases))


if __name__ == "__main__":
    main()
