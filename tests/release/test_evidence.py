"""RDMA port-counter evidence: read with the real shell command, judged per host role."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hgxserve.release.evidence import (
    counters_command,
    parse_counters,
    rdma_roles,
    unchecked_transport,
    verdict,
)
from hgxserve.topology import load_topology
from hgxserve.topology.model import KvTransfer

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


def test_tcp_only_pd_with_the_rdma_check_off_is_said_to_go_over_tcp() -> None:
    cpu = load_topology(str(REPO / "topologies/demo/demo-vllm-cpu-pd.yml"))
    assert rdma_roles(cpu) == {}  # gate.rdma: off
    assert unchecked_transport(cpu) == (
        "KV crossed hosts hgx-a -> hgx-b over TCP (UCX_TLS=tcp,self,sm names no RDMA "
        "transport): RDMA port counters not checked (gate.rdma: off)"
    )
    # checked (auto), or KV on one host: nothing to say
    assert unchecked_transport(load_topology(str(REPO / "topologies/demo/demo-pd.yml"))) is None
    same_host = load_topology(str(REPO / "topologies/h20-v4flash-4p4d.yml"))
    assert unchecked_transport(same_host) is None


def test_rdma_off_without_a_tcp_only_ucx_is_not_called_tcp_or_rdma(tmp_path: Path) -> None:
    text = (REPO / "topologies/demo/demo-pd.yml").read_text() + 'gate: {rdma: "off"}\n'
    topo = tmp_path / "pd-off.yml"
    topo.write_text(text)
    said = unchecked_transport(load_topology(str(topo)))
    assert said == (
        "KV crossed hosts hgx-a -> hgx-b over a transport nothing checked: RDMA port counters "
        "not checked (gate.rdma: off)"
    )


@pytest.mark.parametrize(
    ("tls", "tcp_only"),
    [
        (None, False),  # UCX picks: RDMA when there is a NIC
        (("tcp",), True),
        (("tcp", "self", "sm"), True),
        (("TCP", "cuda_copy", "cuda_ipc"), True),
        (("rc", "cuda_copy"), False),
        (("rc_x",), False),
        (("all",), False),
        (("^tcp",), False),  # everything but TCP
    ],
)
def test_which_ucx_tls_lists_are_tcp_only(tls: tuple[str, ...] | None, tcp_only: bool) -> None:
    kv = KvTransfer("nixl", None, 5600, None, tls, "cuda", "fail", 8998)
    assert kv.ucx_tcp_only is tcp_only
    assert KvTransfer("mooncake", None, 5600, None, tls, "cuda", "fail", 8998).ucx_tcp_only is False
