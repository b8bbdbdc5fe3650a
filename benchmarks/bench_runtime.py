"""The runtime stage on the 3 local test hosts: fresh vs no-op, and a controller-built wheelhouse
pushed to the hosts vs each host downloading from a package index on the controller.

Brings the test hosts up (reusing running ones) and times `deploys/runtime.py` for the demo P/D
topology (the simulated vLLM + NIXL wheels, plus a payload wheel of --payload-mib MiB standing in
for the engine's weight in wheels: a real vLLM wheelhouse is GBs):

- wheelhouse push, fresh hosts (venvs removed; the controller's wheelhouse already cached);
- no-op: the same run again (nothing downloaded, nothing pushed);
- index: fresh hosts, each host runs pip against a PEP 503 index that `python -m http.server`
  serves on the controller bridge (10.77.0.1): the usual way, every host downloading;
- wheelhouse push with a cold controller cache (pip download on the controller first).

Rounds alternate. Needs root; takes the hosts down afterwards unless another run still uses
them. Prints a table, asserts nothing about the time.

    .venv/bin/python benchmarks/bench_runtime.py [--rounds 3] [--payload-mib 64]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed import hosts as testbed_hosts  # noqa: E402
from testbed import simwheels  # noqa: E402

PYINFRA = [str(REPO / ".venv/bin/pyinfra"), "-y", "inventory/testhosts.py"]
VENVS = "/opt/vllm-sim /opt/vllm-bench /var/lib/hgxserve/runtime"


def payload_wheel(out: Path, mib: int) -> None:
    """A pure-Python wheel `hgxserve-bench-payload==1.0` with `mib` MiB of incompressible data."""
    simwheels.build_wheel(
        out,
        "hgxserve-bench-payload",
        "1.0",
        {"hgxserve_bench_payload/data.bin": os.urandom(mib << 20)},
        "benchmark payload standing in for an engine's wheel size (not an engine)",
    )


def simple_index(wheels: Path, root: Path) -> None:
    """A PEP 503 index of `wheels` under root/simple/<name>/."""
    for wheel in wheels.glob("*.whl"):
        name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        project = root / "simple" / name
        project.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheel, project / wheel.name)
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
        (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((testbed_hosts.BRIDGE_ADDRESS, 0))
        return int(sock.getsockname()[1])


def timed(args: list[str], env: dict[str, str]) -> float:
    started = time.monotonic()
    proc = subprocess.run([*PYINFRA, *args], cwd=REPO, capture_output=True, text=True, env=env)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"pyinfra {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--payload-mib", type=int, default=64)
    args = parser.parse_args()
    testbed_hosts.take_lease(os.getpid())
    bed = testbed_hosts.up(3, "h200")
    work = Path(tempfile.mkdtemp(prefix="hgxserve-bench-runtime-"))
    server = None
    try:
        wheels = work / "wheels"
        simwheels.build_all(wheels)
        payload_wheel(wheels, args.payload_mib)
        simple_index(wheels, work / "index")
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", testbed_hosts.BRIDGE_ADDRESS,
             str(port), "--directory", str(work / "index")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        text = (REPO / "topologies/demo/demo-pd.yml").read_text()
        text = text.replace(
            "runtime: {venv: /opt/vllm-sim}",
            "runtime: {venv: /opt/vllm-bench, packages: [hgxserve-bench-payload==1.0]}",
        )
        topology = work / "bench-runtime.yml"
        topology.write_text(text)
        base = ["deploys/runtime.py", "--data", f"topology={topology}"]
        push = [*base, "--data", f"runtime_find_links={wheels}", "--data", "runtime_no_index=true"]
        url = f"http://{testbed_hosts.BRIDGE_ADDRESS}:{port}/simple"
        index = [*base, "--data", "runtime_source=index", "--data", f"runtime_index_url={url}"]
        warm = {**os.environ, "HGXSERVE_CONTROLLER_CACHE": str(work / "cache")}

        def fresh() -> None:
            for name in bed.names:
                bed.ssh(name, f"rm -rf {VENVS}", check=True)

        timed(push, warm)  # fill the controller cache once
        times: dict[str, list[float]] = {
            "wheelhouse push, fresh hosts": [],
            "no-op re-run": [],
            "each host pip from the controller index": [],
            "wheelhouse push, cold controller cache": [],
        }
        for round_no in range(args.rounds):
            fresh()
            times["wheelhouse push, fresh hosts"].append(timed(push, warm))
            times["no-op re-run"].append(timed(push, warm))
            fresh()
            times["each host pip from the controller index"].append(timed(index, warm))
            fresh()
            cold = {**os.environ, "HGXSERVE_CONTROLLER_CACHE": str(work / f"cold-{round_no}")}
            times["wheelhouse push, cold controller cache"].append(timed(push, cold))
        fresh()
        print(
            f"\nruntime stage on {len(bed.names)} test hosts (demo P/D: vllm + nixl simulated "
            f"wheels + {args.payload_mib} MiB payload), {args.rounds} alternating rounds"
        )
        print(f"{'run':44} {'median s':>9} {'min s':>7} {'max s':>7}")
        for name, values in times.items():
            print(
                f"{name:44} {statistics.median(values):9.2f} {min(values):7.2f} {max(values):7.2f}"
            )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
        if not testbed_hosts.drop_lease(os.getpid()):
            testbed_hosts.down()  # the last user of the hosts takes them down


if __name__ == "__main__":
    main()
