"""`hgxserve status` wall time on 3 and 9 test hosts, against the usual way of looking.

Brings up the largest count of test hosts once; for each count, deploys the demo P/D topology
on the first N of them with an inventory of just those (runtime, weights, engines; hosts beyond
hgx-c are named in the topology and hold an empty release), then times, in alternating rounds:

- `hgxserve status T --json`: the whole command as a user runs it (Python start, imports, one
  `hgxserve inspect` per host over parallel SSH, the report);
- the usual way: a sequential shell loop `for h in ...; do ssh h hgxserve release status; done`
  (OpenSSH, one connection per host, only the release links; far less than status gathers);
- pyinfra's API doing what status does (`connect_all` + one `hgxserve inspect` per host in
  gevent greenlets, in a fresh Python): the alternative transport docs/status.md weighs.

Needs root; takes the test hosts down at the end (run it under the e2e lock). Asserts nothing
about the time.

    flock /tmp/hgxserve-e2e.lock .venv/bin/python benchmarks/bench_status.py [--hosts 3,9]
"""

from __future__ import annotations

import argparse
import json
import shlex
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
from testbed.util import TestbedError  # noqa: E402

PD = REPO / "topologies/demo/demo-pd.yml"
INVENTORY = "inventory/testhosts.py"
HGXSERVE = str(REPO / ".venv/bin/hgxserve")
PYTHON = str(REPO / ".venv/bin/python")
AGENT = "/opt/hgxserve/bin/hgxserve"

PYINFRA_API = """
import os, sys
import pyinfra_cli  # gevent monkey-patching, as the pyinfra CLI does
from gevent.pool import Pool
from pyinfra.api import Config, State
from pyinfra.api.connect import connect_all
from pyinfra.context import ctx_inventory, ctx_state
from pyinfra_cli.inventory import make_inventory
from hgxserve.status.report import inspect_argv
from hgxserve.remote.ssh import quote_argv
from hgxserve.topology import load_topology
topo = load_topology(sys.argv[1])
state = State()
ctx_state.set(state)
inventory = make_inventory(sys.argv[2], cwd=os.getcwd())
ctx_inventory.set(inventory)
state.init(inventory, Config())
connect_all(state)
hosts = [h for h in inventory if h.name in topo.hosts]
pool = Pool(len(hosts))
jobs = [pool.spawn(h.run_shell_command, quote_argv(inspect_argv(topo, h.name, sys.argv[3])))
        for h in hosts]
pool.join()
assert all(j.value[0] for j in jobs), [j.value for j in jobs]
print(len(jobs))
"""


def topology_for(count: int, work: Path) -> Path:
    """demo-pd with hosts hgx-d... added (idle: they get an empty release)."""
    text = PD.read_text()
    if count <= 3:
        return PD
    extra = "".join(
        f"  {name}: {{address: 10.77.0.{11 + i}, gpu: H200, gpus: 8}}\n"
        for i, name in enumerate(testbed_hosts.host_names(count))
        if i >= 3
    )
    text = text.replace(
        "  hgx-c: {address: 10.77.0.13, gpu: H200, gpus: 8}\n",
        "  hgx-c: {address: 10.77.0.13, gpu: H200, gpus: 8}\n" + extra,
    )
    path = work / f"demo-pd-{count}.yml"
    path.write_text(text.replace("name: demo-pd\n", f"name: demo-pd-{count}hosts\n"))
    return path


def timed(argv: list[str], *, shell: bool = False) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    proc = subprocess.run(
        argv if not shell else argv[0], shell=shell, cwd=REPO, capture_output=True, text=True
    )
    return time.monotonic() - started, proc


def inventory_of(bed: testbed_hosts.Testbed, names: list[str], work: Path) -> str:
    """A pyinfra inventory file with just these test hosts (a release deploy wants every
    inventory host to be a host of the topology)."""
    from hgxserve.remote.inventory import load_inventory

    full = load_inventory(str(REPO / INVENTORY))  # its host data (ssh, runtime wheel source)
    hosts = [(name, full.hosts[name].data) for name in names]
    path = work / f"inventory-{len(names)}.py"
    path.write_text(f"testhosts = {hosts!r}\n")
    return str(path)


def wait_ssh(bed: testbed_hosts.Testbed, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for name in bed.names:
        while bed.ssh(name, "true", timeout=15).returncode != 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} does not answer over ssh")
            time.sleep(1)


def measure(
    bed: testbed_hosts.Testbed, count: int, rounds: int, work: Path
) -> dict[str, list[float]]:
    names = bed.names[:count]
    inventory = inventory_of(bed, names, work)
    topology = topology_for(count, work)
    deploy = bed.pyinfra(
        "deploys/site.py",
        "--data", f"topology={topology}",
        "--data", "stages=runtime,weights,engines",
        "--data", "health_timeout=75",
        inventory=inventory,
    )  # fmt: skip
    if deploy.returncode != 0:
        tail = (deploy.stdout + deploy.stderr)[-3000:]
        raise SystemExit(f"deploy on {count} hosts failed:\n{tail}")
    loop = "; ".join(
        shlex.join(bed.ssh_argv(name, f"{AGENT} release status")) + " >/dev/null" for name in names
    )
    cases = {
        "hgxserve status --json": ([HGXSERVE, "status", str(topology), "-i", inventory,
                                    "--json"], False),
        "ssh loop: hgxserve release status": ([f"set -e; {loop}"], True),
        "pyinfra API: connect_all + inspect": ([PYTHON, "-c", PYINFRA_API, str(topology),
                                                inventory, AGENT], False),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (argv, shell) in cases.items():
            elapsed, proc = timed(argv, shell=shell)
            if name.startswith("hgxserve") and proc.returncode == 2:
                raise SystemExit(f"{name} could not tell on {count} hosts:\n{proc.stdout[-3000:]}")
            if name.startswith("hgxserve") and proc.returncode != 0:
                # still a full gather of every host; say so beside the figures
                report = json.loads(proc.stdout)
                print(f"{count} hosts: status says {report['verdict']}: "
                      f"{[p['message'] for p in report['problems']][:3]}")  # fmt: skip
            if not name.startswith("hgxserve") and proc.returncode != 0:
                raise SystemExit(f"{name} failed: {proc.stderr[-2000:]}")
            times[name].append(elapsed)
    print_table({count: times}, rounds)
    return times


def print_table(results: dict[int, dict[str, list[float]]], rounds: int) -> None:
    print(f"\nstatus wall time, {rounds} alternating rounds (seconds)", flush=True)
    print(f"{'hosts':>5}  {'how':38} {'median':>7} {'min':>6} {'max':>6}")
    for count, times in results.items():
        for name, values in times.items():
            print(
                f"{count:5}  {name:38} {statistics.median(values):7.2f} "
                f"{min(values):6.2f} {max(values):6.2f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", default="3,9", help="host counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="leave the test hosts up")
    args = parser.parse_args()
    counts = sorted(int(c) for c in args.hosts.split(","))
    results: dict[int, dict[str, list[float]]] = {}
    bed = testbed_hosts.up(counts[-1], "h200")  # once, for every count: no host replaced
    try:
        wait_ssh(bed)
        for name in bed.names:
            bed.ssh(name, demo.FORGET_RELEASES)
        with tempfile.TemporaryDirectory() as tmp:
            demo.prepare(bed.names, Path(tmp) / "model")
            for count in counts:
                results[count] = measure(bed, count, args.rounds, Path(tmp))
    finally:
        demo.stop_s3()
        if not args.keep:
            try:
                testbed_hosts.down()
            except TestbedError as exc:
                print(f"testbed: {exc}", file=sys.stderr)
    print_table(results, args.rounds)


if __name__ == "__main__":
    main()
