"""The fabric preflight end to end on real test hosts: the real pyinfra CLI over SSH, the
simulated ib_write_bw (testbed/fakes/ib_write_bw.py) talking TCP between the hosts and printing
perftest's report, the simulated RDMA sysfs the hosts have instead of /sys/class/infiniband.

A healthy fabric passes and its figures are in the release's record; a rail that is down, and a
host whose rails give half their bandwidth, stop the release before any unit changes, naming
the host, the rail and the figure measured.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import demo_lab, links, output, units

from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
RAILS = "rdma: [mlx5_0, mlx5_1]"
SIM_PORT = f"{testbed_hosts.SIM_RDMA_DIR}/{{rail}}/ports/1/state"
FAULTS = "/etc/hgxserve-testbed/fabric"


def fabric_topology(
    tmp_path: Path, name: str, max_num_seqs: int = 8, extra: dict[str, str] | None = None
) -> Path:
    """demo-pd with two rails on the P/D hosts (and `max_num_seqs` for a new release id)."""
    text = PD.read_text()
    for old, new in (extra or {}).items():
        assert old in text
        text = text.replace(old, new)
    for host, address in (("hgx-a", "10.77.0.11"), ("hgx-b", "10.77.0.12")):
        old = f"{host}: {{address: {address}, gpu: H200, gpus: 8}}"
        assert old in text
        text = text.replace(old, f"{host}: {{address: {address}, gpu: H200, gpus: 8, {RAILS}}}")
    text = text.replace("max_num_seqs: 8", f"max_num_seqs: {max_num_seqs}")
    path = tmp_path / f"{name}.yml"
    path.write_text(text.replace("name: demo-pd", f"name: {name}"))
    return path


def clear_faults(lab: testbed_hosts.Testbed) -> None:
    for host in lab.names:
        ports = " ".join(SIM_PORT.format(rail=r) for r in ("mlx5_0", "mlx5_1"))
        lab.ssh(host, f"rm -f {FAULTS}; for f in {ports}; do echo '4: ACTIVE' > $f; done")


def deploy_with_fault(
    lab: testbed_hosts.Testbed, host: str, fault: str, topology: Path, *data: str
) -> subprocess.CompletedProcess:
    """`deploy` of the engines stage while `fault` (a shell command that sets a fault of the
    simulated fabric) holds on `host`; every fault is cleared after."""
    lab.ssh(host, fault, check=True)
    try:
        return deploy(lab, topology, "engines", *data)
    finally:
        clear_faults(lab)


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    clear_faults(testbed)
    with demo_lab(testbed, tmp_path_factory.mktemp("demo"), runtime=PD) as bed:
        yield bed
        clear_faults(bed)


def deploy(
    lab: testbed_hosts.Testbed, topology: Path, stages: str, *data: str
) -> subprocess.CompletedProcess:
    extra = [arg for item in data for arg in ("--data", item)]
    return lab.pyinfra(
        "deploys/site.py",
        *extra,
        "--data",
        f"topology={topology}",
        "--data",
        f"stages={stages}",
        "--data",
        "health_timeout=75",
        "--data",
        "confirm_within=120",
    )


def fabric_record(lab: testbed_hosts.Testbed, host: str, release_id: str) -> dict:
    path = f"/var/lib/hgxserve/releases/{release_id}/fabric.json"
    return json.loads(lab.ssh(host, f"cat {path}", check=True).stdout)


def snapshot(lab: testbed_hosts.Testbed) -> dict[str, tuple]:
    """Each host's current release, pending switch and running units with their PIDs."""
    out = {}
    for host in lab.names:
        state = links(lab, host)
        out[host] = (state["current"], state["pending"], units(lab, host))
    return out


def test_a_healthy_fabric_passes_and_its_figures_are_in_the_release_record(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    proc = deploy(lab, fabric_topology(tmp_path, "demo-pd-fabric"), "weights,engines")
    assert proc.returncode == 0, output(proc)[-5000:]
    assert "fabric preflight passed: hgx-a->hgx-b mlx5_0" in output(proc)
    for host in ("hgx-a", "hgx-b"):
        state = links(lab, host)
        assert state["pending"] is None
        record = fabric_record(lab, host, state["current"])
        assert record["verdict"] == "pass" and record["shortfalls"] == []
        assert {k: v["state"] for k, v in record["links"].items()} == {
            "mlx5_0/1": "ACTIVE",
            "mlx5_1/1": "ACTIVE",
        }
        figures = {m["rail"]: m["average_gbps"] for m in record["bandwidth"]}
        assert set(figures) == {"mlx5_0", "mlx5_1"}
        # 97% of the simulated ports' 400 Gb/s, above the 0.8 x 400 floor
        assert all(380 < gbps < 400 for gbps in figures.values()), figures
        assert all(m["floor_gbps"] == 320 for m in record["bandwidth"])
    assert links(lab, "hgx-c")["pending"] is None  # no rails: nothing kept, still switched
    print("\n".join(line for line in output(proc).splitlines() if "fabric" in line.lower()))
    # nothing changed: no host switches, so nothing is measured again
    again = deploy(lab, fabric_topology(tmp_path, "demo-pd-fabric"), "engines")
    assert again.returncode == 0, output(again)[-5000:]
    assert "Fabric:" not in output(again) and "ib_write_bw" not in output(again)
    # only the proxy's routing changes: only hgx-c switches, and the P/D hosts still measure
    routing = {"pd_min_prompt_tokens: 64": "pd_min_prompt_tokens: 48"}
    proxy_only = deploy(lab, fabric_topology(tmp_path, "demo-pd-fabric", extra=routing), "engines")
    assert proxy_only.returncode == 0, output(proxy_only)[-5000:]
    assert "fabric preflight passed: hgx-a->hgx-b mlx5_0" in output(proxy_only)


def test_a_rail_down_on_one_host_stops_the_release_before_any_unit_changes(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = snapshot(lab)
    proc = deploy_with_fault(
        lab,
        "hgx-b",
        f"echo '1: DOWN' > {SIM_PORT.format(rail='mlx5_1')}",
        fabric_topology(tmp_path, "demo-pd-fabric", 6),
    )
    text = output(proc)
    assert proc.returncode != 0, text[-5000:]
    assert "FABRIC SHORT: hgx-b rail mlx5_1 port 1 is DOWN (sysfs state), not ACTIVE" in text
    # the client could not reach the server whose port is down: the measurement names it too
    assert "ib_write_bw hgx-a -> hgx-b rail mlx5_1 measured nothing" in text
    assert "stopped before any unit changed on any host" in text
    print("\n".join(line for line in text.splitlines() if "FABRIC" in line))
    assert snapshot(lab) == before


def test_half_bandwidth_on_one_host_stops_the_release_naming_the_figure(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = snapshot(lab)
    proc = deploy_with_fault(
        lab,
        "hgx-b",
        f"echo 'bw_factor: 0.5' > {FAULTS}",
        fabric_topology(tmp_path, "demo-pd-fabric", 6),
    )
    text = output(proc)
    assert proc.returncode != 0, text[-5000:]
    for rail in ("mlx5_0", "mlx5_1"):
        match = re.search(
            rf"FABRIC SHORT: ib_write_bw hgx-a -> hgx-b rail {rail}: ([\d.]+) Gb/s average, "
            r"below 320 Gb/s \(0.8 x the 400 Gb/s rail\)",
            text,
        )
        assert match, text[-5000:]
        assert 190 < float(match.group(1)) < 200  # half of 97% of 400 Gb/s
    print("\n".join(line for line in text.splitlines() if "FABRIC" in line))
    assert snapshot(lab) == before
    # gate.fabric: warn says the same and goes on; the record keeps the short figures
    warn = {"\nwarmup:": "\ngate: {fabric: warn}\nwarmup:"}
    proc = deploy_with_fault(
        lab,
        "hgx-b",
        f"echo 'bw_factor: 0.5' > {FAULTS}",
        fabric_topology(tmp_path, "demo-pd-fabric", 6, warn),
    )
    assert proc.returncode == 0, output(proc)[-5000:]
    assert "FABRIC SHORT: ib_write_bw hgx-a -> hgx-b rail mlx5_0" in output(proc)
    assert "going on (gate.fabric: warn)" in output(proc)
    state = links(lab, "hgx-a")
    assert state["current"] != before["hgx-a"][0] and state["pending"] is None
    record = fabric_record(lab, "hgx-a", state["current"])
    assert record["verdict"] == "short" and record["policy"] == "warn"
    assert all(190 < m["average_gbps"] < 200 for m in record["bandwidth"])


MPIRUN = "nccl_mpirun=/usr/local/bin/mpirun"  # the simulated Open MPI launcher on the hosts


def multi_host_topology(tmp_path: Path, name: str, max_num_seqs: int = 8) -> Path:
    """demo-pd with its decode across hgx-b and hgx-c (DP 2, TP 4 on each), rails on both."""
    text = PD.read_text()
    for host, address in (("hgx-b", "10.77.0.12"), ("hgx-c", "10.77.0.13")):
        old = f"{host}: {{address: {address}, gpu: H200, gpus: 8}}"
        text = text.replace(old, f"{host}: {{address: {address}, gpu: H200, gpus: 8, {RAILS}}}")
    old = "place: {hgx-b: [0, 1, 2, 3]}\n    tp: 4"
    assert old in text
    text = text.replace(
        old, "place: {hgx-b: [0, 1, 2, 3], hgx-c: [4, 5, 6, 7]}\n    tp: 4\n    dp: 2"
    )
    text = text.replace("max_num_seqs: 8", f"max_num_seqs: {max_num_seqs}")
    # the simulated DP rank on hgx-c pulls no KV, so its NIC counters cannot be the gate's
    # evidence here; the fabric preflight is what this topology is for
    text = text.replace("\nwarmup:", "\ngate: {rdma: off}\nwarmup:")
    path = tmp_path / f"{name}.yml"
    path.write_text(text.replace("name: demo-pd", f"name: {name}"))
    return path


@pytest.fixture
def mpi_ssh(lab: testbed_hosts.Testbed) -> Iterator[testbed_hosts.Testbed]:
    """SSH from hgx-b (the engine's head, where mpirun runs) to hgx-c, as a site sets it up for
    MPI; taken away afterwards."""
    key = "/root/.ssh/hgxserve_test_mpi"
    lab.ssh(
        "hgx-b", f"test -f {key} || ssh-keygen -q -t ed25519 -N '' -C mpi-test -f {key}", check=True
    )
    public = lab.ssh("hgx-b", f"cat {key}.pub", check=True).stdout.strip()
    lab.ssh(
        "hgx-c",
        f"mkdir -p /root/.ssh && echo {shlex.quote(public)} >> /root/.ssh/authorized_keys",
        check=True,
    )
    lab.ssh(
        "hgx-b",
        f"printf 'Host 10.77.0.13\\n  IdentityFile {key}\\n' > /root/.ssh/config",
        check=True,
    )
    known = lab.ssh("hgx-b", "test -e /root/.ssh/known_hosts").returncode == 0
    yield lab
    lab.ssh("hgx-c", "sed -i '/ mpi-test$/d' /root/.ssh/authorized_keys")
    lab.ssh("hgx-b", f"rm -f /root/.ssh/config {key} {key}.pub")
    if not known:  # the host key mpirun's SSH accepted
        lab.ssh("hgx-b", "rm -f /root/.ssh/known_hosts /root/.ssh/known_hosts.old")


def test_a_multi_host_engine_gets_an_nccl_all_reduce_and_a_slow_host_stops_it(
    mpi_ssh: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    lab = mpi_ssh
    proc = deploy(lab, multi_host_topology(tmp_path, "demo-mh-fabric"), "weights,engines", MPIRUN)
    assert proc.returncode == 0, output(proc)[-5000:]
    print("\n".join(line for line in output(proc).splitlines() if "fabric" in line.lower()))
    state = links(lab, "hgx-b")
    (allreduce,) = fabric_record(lab, "hgx-b", state["current"])["allreduce"]
    assert allreduce["hosts"] == ["hgx-b", "hgx-c"] and allreduce["gpus_per_host"] == 4
    # 2 rails x 400 Gb/s at the simulation's 92%: 92 GB/s, above 0.7 x 100 GB/s
    assert allreduce["avg_busbw_gbytes"] == pytest.approx(92.0) and allreduce["floor_gbytes"] == 70
    before = snapshot(lab)
    proc = deploy_with_fault(
        lab,
        "hgx-c",
        f"echo 'bw_factor: 0.5' > {FAULTS}",
        multi_host_topology(tmp_path, "demo-mh-fabric", 6),
        MPIRUN,
    )
    text = output(proc)
    assert proc.returncode != 0, text[-5000:]
    assert (
        "FABRIC SHORT: NCCL all-reduce of decode-0 across hgx-b+hgx-c (rails mlx5_0,mlx5_1): "
        "46 GB/s bus bandwidth, below 70 GB/s (0.7 x the slowest host's 800 Gb/s of rails)"
    ) in text
    print("\n".join(line for line in text.splitlines() if "FABRIC" in line))
    assert snapshot(lab) == before
