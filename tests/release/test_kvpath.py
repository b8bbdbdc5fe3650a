"""KV path evidence: UCX's protocol-selection tables (real samples), read from a unit's current
run with the real shell command, and judged per P/D route."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import subprocess
from pathlib import Path

import pytest

from hgxserve.operations.release import _rdma_evidence
from hgxserve.parsers.ucxproto import ProtoTable, _cells, parse_proto_info
from hgxserve.release.coordination import Coordination
from hgxserve.release.kvpath import (
    KvEndpoint,
    journal_command,
    kv_endpoints,
    parse_journal,
    transport_verdict,
)
from hgxserve.topology import load_topology
from testbed import simengine

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests/fixtures/ucx"
PD = REPO / "topologies/demo/demo-pd.yml"
GET = "remote memory read by ucp_get*(multi) into cuda/GPU0"
DECODE = KvEndpoint(0, "decode-0", "decode", "hgx-b", ("hgx-a",))
PREFILL = KvEndpoint(0, "prefill-0", "prefill", "hgx-a", ("hgx-b",))


def fixture(name: str) -> list[str]:
    """A real capture, without its `# source:` header line."""
    return (FIXTURES / name).read_text().splitlines()[1:]


def table(endpoint: str, lanes: str, operation: str = GET) -> ProtoTable:
    return ProtoTable(endpoint, operation, [("0..inf", "zero-copy", lanes)])


def test_the_real_table_with_the_older_prefix_and_endpoint_name() -> None:
    [t] = parse_proto_info(fixture("proto-info_openucx-issues.txt"))
    assert t.endpoint == "mpi ep_cfg[3]"
    assert t.operation == "tagged message by ucp_tag_send*() from host memory"
    assert len(t.rows) == 4 and t.rows[-1][1] == "(?) rendezvous zero-copy read from remote"
    assert t.lanes == ["rc_mlx5/mlx5_0:1"] and t.transports == ["rc_mlx5"]
    assert t.locality == "" and not t.rma  # the older UCX does not say inter-node


def test_the_real_compact_lines_and_a_row_over_two_rails() -> None:
    lines = fixture("proto-info_openucx-issue-9971.txt")
    # rows above the first header in the capture belong to no table
    [t] = parse_proto_info(lines)
    assert t.endpoint == "perftest inter-node cfg#0" and t.locality == "inter-node"
    assert t.operation.startswith("active message by ucp_am_send*(fast-completion)")
    cells = _cells(lines[3])
    assert cells == [
        "29421..inf",
        "(?) rendezvous zero-copy read from remote",
        "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_2:1",
    ]
    two = ProtoTable(t.endpoint, GET, [tuple(c) for c in (_cells(x) for x in lines[:4]) if c])
    assert two.lanes == ["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_2:1"] and two.rma


def test_the_simulated_engine_prints_what_the_parser_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_PROTO_INFO", "y")
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_3:1")
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("HGXSERVE_SIM_KV_TRANSPORT", raising=False)
    monkeypatch.setattr(simengine, "_proto_info_said", set())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        simengine.proto_info("10.77.0.12", "10.77.0.11", GET)
        simengine.proto_info("10.77.0.12", "10.77.0.11", GET)  # once per endpoint
        monkeypatch.setenv("HGXSERVE_SIM_KV_TRANSPORT", "tcp")
        simengine.proto_info("10.77.0.12", "10.77.0.13", GET)
        simengine.proto_info("127.0.0.1", "127.0.0.1", GET)
    rdma, tcp, local = parse_proto_info(out.getvalue().splitlines())
    assert (rdma.locality, rdma.rma, rdma.lanes) == ("inter-node", True, ["rc_mlx5/mlx5_3:1"])
    assert tcp.rows[0][1] == "software emulation" and tcp.transports == ["tcp"]
    assert (local.locality, local.lanes) == ("intra-node", ["cuda_ipc/cuda"])
    assert out.getvalue().splitlines()[0].startswith("[")  # UCX's compact log prefix


def test_the_kv_endpoints_are_the_nixl_engines_of_routes_across_hosts(tmp_path: Path) -> None:
    assert kv_endpoints(load_topology(str(PD))) == [PREFILL, DECODE]
    off = tmp_path / "off.yml"
    off.write_text(PD.read_text() + 'gate: {rdma: "off"}\n')
    assert kv_endpoints(load_topology(str(off))) == []
    assert kv_endpoints(load_topology(str(REPO / "topologies/h20-v4flash-4p4d.yml"))) == []
    multi = kv_endpoints(load_topology(str(REPO / "topologies/h200-dsv32-2p1d.yml")))
    assert {(e.engine, e.host) for e in multi if e.role == "decode"} == {
        ("decode-0", "h200-e"),
        ("decode-0", "h200-f"),
    }


def test_the_journal_of_the_units_current_run_is_read(tmp_path: Path) -> None:
    # systemctl and journalctl as the host answers them: the unit's invocation, its lines
    lines = [
        "INFO 12-01 [nixl_connector.py] NIXL is available",
        "[1764600000.1] [hgx-b:42:0]   +----------+",
        f"[1764600000.1] [hgx-b:42:0]   | ucp_context_0 inter-node cfg#1 | {GET} |",
        "[1764600000.1] [hgx-b:42:0]   |     0..inf | zero-copy | rc_mlx5/mlx5_0:1 |",
    ]
    (tmp_path / "journal").write_text("\n".join(lines) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "systemctl": 'case "$*" in *decode-0*) echo 3f2a;; *) echo;; esac\n',
        "journalctl": f'[ "$1" = _SYSTEMD_INVOCATION_ID=3f2a ] || exit 1\ncat {tmp_path}/journal\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    command = journal_command(["hgxserve-decode-0.service", "hgxserve-prefill-0.service"])
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    read = parse_journal(out.stdout.splitlines())
    assert read["hgxserve-prefill-0.service"] == []  # no current run: nothing read
    [t] = read["hgxserve-decode-0.service"]
    assert t.lanes == ["rc_mlx5/mlx5_0:1"] and t.operation == GET


def test_kv_over_tcp_fails_naming_host_engine_peer_and_transport() -> None:
    read = {"hgx-b": {DECODE.unit: [table("ucp_context_0 inter-node cfg#1", "tcp/host0")]}}
    ok, message = transport_verdict([PREFILL, DECODE], read)
    assert not ok
    assert "KV went over TCP" in message
    assert f"decode-0 on hgx-b (KV from hgx-a): tcp/host0 for {GET}" in message


def test_kv_over_rdma_passes_naming_the_lanes() -> None:
    rails = "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_2:1"
    read = {"hgx-b": {DECODE.unit: [table("ucp_context_0 inter-node cfg#1", rails)]}}
    ok, message = transport_verdict([PREFILL, DECODE], read)
    assert ok, message
    assert message.startswith("KV over RDMA: UCX selected decode-0 on hgx-b (KV from hgx-a): ")
    assert "rc_mlx5/mlx5_0:1 and rc_mlx5/mlx5_2:1" in message


@pytest.mark.parametrize(
    "tables",
    [
        [],  # UCX printed nothing (UCX_PROTO_INFO not honoured)
        [table("ucp_context_0 intra-node cfg#0", "cuda_ipc/cuda")],  # not to the other host
        [table("ucp_context_0 inter-node cfg#2", "rc_mlx5/mlx5_0:1", "active message by "
               "ucp_am_send* from host memory")],  # control messages, not the KV itself
    ],
)  # fmt: skip
def test_nothing_proving_rdma_for_the_kv_fails(tables: list[ProtoTable]) -> None:
    ok, message = transport_verdict([PREFILL, DECODE], {"hgx-b": {DECODE.unit: tables}})
    assert not ok and "names an RDMA transport" in message
    assert "decode-0 on hgx-b" in message and "prefill-0 on hgx-a" in message


def test_counters_that_moved_do_not_save_kv_that_went_over_tcp() -> None:
    coord = Coordination(verdict=(True, "gate passed"))
    coord.rdma_roles = {"hgx-a": {"port_xmit_data"}, "hgx-b": {"port_rcv_data"}}
    coord.rdma_before = {"hgx-a": {"m/1/port_xmit_data": 0}, "hgx-b": {"m/1/port_rcv_data": 0}}
    coord.rdma_after = {"hgx-a": {"m/1/port_xmit_data": 10}, "hgx-b": {"m/1/port_rcv_data": 10}}
    coord.kv_endpoints = [PREFILL, DECODE]
    coord.kv_proto = {"hgx-b": {DECODE.unit: [table("c inter-node cfg#1", "tcp/host0")]}}
    _rdma_evidence(coord)
    assert coord.verdict is not None and not coord.verdict[0]
    said = coord.verdict[1]
    assert said.startswith("gate failed: KV went over TCP")
    assert "RDMA port counters grew: hgx-a sent 40 B; hgx-b received 40 B (supporting only" in said
    # over RDMA: both said, the release goes on
    coord = Coordination(verdict=(True, "gate passed"), rdma_roles=coord.rdma_roles)
    coord.rdma_before = {"hgx-a": {"m/1/port_xmit_data": 0}, "hgx-b": {"m/1/port_rcv_data": 0}}
    coord.rdma_after = {"hgx-a": {"m/1/port_xmit_data": 1}, "hgx-b": {"m/1/port_rcv_data": 1}}
    coord.kv_endpoints = [PREFILL, DECODE]
    coord.kv_proto = {"hgx-b": {DECODE.unit: [table("c inter-node cfg#1", "rc_mlx5/m:1")]}}
    _rdma_evidence(coord)
    assert coord.verdict == (True, "gate passed")
    assert coord.rdma_note is not None and coord.rdma_note.startswith("KV over RDMA: UCX selected")
    assert "; RDMA port counters grew" in coord.rdma_note


def test_counters_that_did_not_move_are_said_as_well() -> None:
    # UCX_TLS=tcp: the KV path and the counters both say TCP; both are in the message
    coord = Coordination(verdict=(True, "gate passed"))
    coord.rdma_roles = {"hgx-a": {"port_xmit_data"}, "hgx-b": {"port_rcv_data"}}
    coord.rdma_before = {"hgx-a": {"m/1/port_xmit_data": 0}, "hgx-b": {"m/1/port_rcv_data": 0}}
    coord.rdma_after = dict(coord.rdma_before)
    coord.kv_endpoints = [PREFILL, DECODE]
    coord.kv_proto = {"hgx-b": {DECODE.unit: [table("c inter-node cfg#1", "tcp/host0")]}}
    _rdma_evidence(coord)
    assert coord.verdict is not None and not coord.verdict[0]
    assert "KV went over TCP" in coord.verdict[1]
    assert "RDMA port counters did not move" in coord.verdict[1]
    assert "TCP fallback" in coord.verdict[1]
