"""RDMA port-counter evidence: read with the real shell command, judged per host role."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hgxserve.release.evidence import counters_command, parse_counters, rdma_roles, verdict
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]


def write(root: Path, device: str, xmit: int, rcv: int) -> None:
    counters = root / device / "ports/1/counters"
    counters.mkdir(parents=True, exist_ok=True)
    (counters / "port_xmit_data").write_text(f"{xmit}\n")
    (counters / "port_rcv_data").write_text(f"{rcv}\n")


def read(root: Path, devices: tuple[str, ...] = ()) -> dict[str, int]:
    out = subprocess.run(
        ["sh", "-c", counters_command(str(root), devices)], capture_output=True, text=True
    )
    assert out.returncode == 0
    return parse_counters(out.stdout.splitlines())


def test_counters_are_read_for_all_or_the_named_devices(tmp_path: Path) -> None:
    write(tmp_path, "mlx5_0", 10, 20)
    write(tmp_path, "mlx5_1", 30, 40)
    assert read(tmp_path) == {
        "mlx5_0/1/port_xmit_data": 10,
        "mlx5_0/1/port_rcv_data": 20,
        "mlx5_1/1/port_xmit_data": 30,
        "mlx5_1/1/port_rcv_data": 40,
    }
    assert set(read(tmp_path, ("mlx5_1",))) == {"mlx5_1/1/port_xmit_data", "mlx5_1/1/port_rcv_data"}
    assert read(tmp_path / "none") == {}


def test_verdict_needs_prefill_sent_and_decode_received() -> None:
    roles = {"hgx-a": {"port_xmit_data"}, "hgx-b": {"port_rcv_data"}}
    before = {"hgx-a": {"mlx5_0/1/port_xmit_data": 5}, "hgx-b": {"mlx5_0/1/port_rcv_data": 7}}
    moved = {"hgx-a": {"mlx5_0/1/port_xmit_data": 105}, "hgx-b": {"mlx5_0/1/port_rcv_data": 107}}
    ok, message = verdict(roles, before, moved, "/sys/class/infiniband")
    assert ok and "hgx-a sent 400 B" in message and "hgx-b received 400 B" in message
    still = {"hgx-a": moved["hgx-a"], "hgx-b": before["hgx-b"]}
    ok, message = verdict(roles, before, still, "/sys/class/infiniband")
    assert not ok and "TCP fallback" in message and "hgx-b received 0 B" in message
    ok, message = verdict(roles, before, {"hgx-a": moved["hgx-a"], "hgx-b": {}}, "/x")
    assert not ok and "no RDMA port counters under /x on hgx-b" in message


def test_roles_only_for_pd_across_hosts() -> None:
    pd = load_topology(str(REPO / "topologies/demo/demo-pd.yml"))
    assert rdma_roles(pd) == {"hgx-a": {"port_xmit_data"}, "hgx-b": {"port_rcv_data"}}
    same_host = load_topology(str(REPO / "topologies/h20-v4flash-4p4d.yml"))
    assert rdma_roles(same_host) == {}
    baseline = load_topology(str(REPO / "topologies/demo/demo-baseline.yml"))
    assert rdma_roles(baseline) == {}
