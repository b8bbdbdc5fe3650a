"""KV path evidence: UCX's protocol-selection tables (real samples), read from a unit's current
run with the real shell command, and judged per P/D route."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from hgxserve.cli.release import release
from hgxserve.deploy.plans import _counter_devices
from hgxserve.deploy.switching import run_plan
from hgxserve.operations.release import _rdma_evidence, read_kv_path
from hgxserve.parsers.ucxproto import ProtoTable, _cells, parse_proto_info
from hgxserve.release.coordination import Coordination, RunPlan, RunRecord
from hgxserve.release.kvpath import (
    KvEndpoint,
    UnitRead,
    journal_command,
    kv_endpoints,
    kv_only_rails,
    parse_journal,
    transport_verdict,
    unit_record,
)
from hgxserve.release.store import Store
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


def decode_read(*tables: ProtoTable, whole_run: bool = True) -> dict[str, dict[str, UnitRead]]:
    """What the deploy read on the decode's host: its unit's tables."""
    return {"hgx-b": {DECODE.unit: UnitRead(list(tables), whole_run)}}


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


@pytest.fixture
def journal_path(tmp_path: Path) -> str:
    """A PATH whose systemctl and journalctl answer as a host does for a decode unit whose
    current run (invocation 3f2a) logged one UCX table among other lines."""
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
        "journalctl": (
            'case "$*" in *" INVOCATION_ID=3f2a"*) echo "Started hgxserve-decode-0.service";; '
            f"*_SYSTEMD_INVOCATION_ID=3f2a*) cat {tmp_path}/journal;; *) exit 1;; esac\n"
        ),
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_the_journal_of_the_units_current_run_is_read(journal_path: str) -> None:
    env = {**os.environ, "PATH": journal_path}
    command = journal_command(["hgxserve-decode-0.service", "hgxserve-prefill-0.service"])
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    read = parse_journal(out.stdout.splitlines())
    # no current run: nothing read
    assert read["hgxserve-prefill-0.service"] == UnitRead([], whole_run=False)
    assert read["hgxserve-decode-0.service"].whole_run
    [t] = read["hgxserve-decode-0.service"].tables
    assert t.lanes == ["rc_mlx5/mlx5_0:1"] and t.operation == GET


def test_kv_over_tcp_fails_naming_host_engine_peer_and_transport() -> None:
    read = decode_read(table("ucp_context_0 inter-node cfg#1", "tcp/host0"))
    ok, message = transport_verdict([PREFILL, DECODE], read)
    assert not ok
    assert "KV went over TCP" in message
    assert f"decode-0 on hgx-b (KV from hgx-a): tcp/host0 for {GET}" in message


def test_kv_over_rdma_passes_naming_the_lanes() -> None:
    rails = "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_2:1"
    read = decode_read(table("ucp_context_0 inter-node cfg#1", rails))
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
    ok, message = transport_verdict([PREFILL, DECODE], decode_read(*tables))
    assert not ok and "names an RDMA transport" in message
    assert "decode-0 on hgx-b" in message and "prefill-0 on hgx-a" in message
    # not read at all (the host's read failed): the same
    assert not transport_verdict([PREFILL, DECODE], {})[0]


def test_a_run_older_than_the_journal_is_said_not_failed() -> None:
    # an engine this release did not restart, whose start (and UCX's tables) rotated away
    ok, message = transport_verdict([PREFILL, DECODE], decode_read(whole_run=False))
    assert ok
    assert message == (
        "the UCX tables of decode-0 on hgx-b are no longer in the journal (their run started "
        "before its oldest entry)"
    )
    # ... but TCP in what is still there fails, and another route without tables too
    tcp = decode_read(table("c inter-node cfg#1", "tcp/eth0"), whole_run=False)
    assert not transport_verdict([PREFILL, DECODE], tcp)[0]
    other = KvEndpoint(1, "decode-1", "decode", "hgx-c", ("hgx-a",))
    ok, message = transport_verdict([PREFILL, DECODE, other], decode_read(whole_run=False))
    assert not ok and "(decode-1 on hgx-c) names an RDMA transport" in message


ROLES = {"hgx-a": {"port_xmit_data"}, "hgx-b": {"port_rcv_data"}}
NONE_SENT = {"hgx-a": {"m/1/port_xmit_data": 0}, "hgx-b": {"m/1/port_rcv_data": 0}}


def _gated(plan: RunPlan, grew: int, lanes: str) -> Coordination:
    """A run whose probes passed, with the P/D hosts' counters grown by `grew` words and the
    decode engine's UCX table naming `lanes`."""
    after = {h: {k: v + grew for k, v in counters.items()} for h, counters in NONE_SENT.items()}
    record = RunRecord(verdict=(True, "gate passed"), rdma_before=NONE_SENT, rdma_after=after)
    record.kv_proto = decode_read(table("c inter-node cfg#1", lanes))
    return Coordination(plan, record)


def test_counters_that_moved_do_not_save_kv_that_went_over_tcp() -> None:
    plan = RunPlan(rdma_roles=ROLES, kv_endpoints=[PREFILL, DECODE])
    coord = _gated(plan, 10, "tcp/host0")
    _rdma_evidence(coord)
    verdict = coord.record.verdict
    assert verdict is not None and not verdict[0]
    said = verdict[1]
    assert said.startswith("gate failed: KV went over TCP")
    assert "RDMA port counters grew: hgx-a sent 40 B; hgx-b received 40 B (supporting only" in said
    # over RDMA: both said, the release goes on
    coord = _gated(plan, 1, "rc_mlx5/m:1")
    _rdma_evidence(coord)
    assert coord.record.verdict == (True, "gate passed")
    note = coord.transport_note
    assert note is not None and note.startswith("KV over RDMA: UCX selected")
    assert "; RDMA port counters grew" in note


def test_counters_that_did_not_move_are_said_as_well() -> None:
    # UCX_TLS=tcp: the KV path and the counters both say TCP; both are in the message
    coord = _gated(RunPlan(rdma_roles=ROLES, kv_endpoints=[PREFILL, DECODE]), 0, "tcp/host0")
    _rdma_evidence(coord)
    verdict = coord.record.verdict
    assert verdict is not None and not verdict[0]
    assert "KV went over TCP" in verdict[1]
    assert "RDMA port counters did not move" in verdict[1]
    assert "TCP fallback" in verdict[1]


def test_what_nothing_checked_is_said_and_not_judged() -> None:
    # gate.rdma: off: the plan's note is what the confirmed release says, nothing is judged
    unchecked = "KV crossed hosts hgx-a -> hgx-b over TCP: RDMA port counters not checked"
    coord = _gated(RunPlan(kv_endpoints=[PREFILL, DECODE], unchecked=unchecked), 0, "tcp/h0")
    _rdma_evidence(coord)
    assert coord.record.verdict == (True, "gate passed") and coord.record.rdma_note is None
    assert coord.transport_note == unchecked


def two_p_one_d(tmp_path: Path, env: str, kv_devices: str) -> str:
    """The 2P1D seed topology (DP/EP engines spanning two hosts each) with `env` for every
    engine and `kv_devices` as each engine's kv.ucx_devices."""
    text = (REPO / "topologies/h200-dsv32-2p1d.yml").read_text()
    eight = ", ".join(f"mlx5_{i}:1" for i in range(8))
    assert text.count(f"ucx_devices: [{eight}]") == 3
    text = text.replace(f"ucx_devices: [{eight}]", f"ucx_devices: {kv_devices}")
    text = text.replace("defaults:\n  engine: vllm\n", f"defaults:\n  engine: vllm\n  env: {env}\n")
    path = tmp_path / "2p1d.yml"
    path.write_text(text)
    return str(path)


def test_kv_only_rails_when_the_topology_tells_them(tmp_path: Path) -> None:
    # one host per engine: the NICs carry only KV, the kv.ucx_devices are the rails
    h20 = load_topology(str(REPO / "topologies/h20-v4flash-1p1d-2node.yml"))
    assert kv_only_rails(h20, "h20-b") == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    # the 2P1D seed: DP/EP engines across hosts with no NCCL_IB_HCA: any NIC may carry either
    assert (
        kv_only_rails(load_topology(str(REPO / "topologies/h200-dsv32-2p1d.yml")), "h200-e") is None
    )
    six = ",".join(f"mlx5_{i}" for i in range(6))
    dp_ep = f'{{NCCL_IB_HCA: "{six}", NVSHMEM_HCA_LIST: "{six.replace(",", ":1,")}:1"}}'
    split = load_topology(two_p_one_d(tmp_path, dp_ep, "[mlx5_6:1, mlx5_7:1]"))
    assert kv_only_rails(split, "h200-e") == ["mlx5_6", "mlx5_7"]
    # overlap with the DP/EP HCAs, `all`, NCCL told but DeepEP's NVSHMEM not: cannot be told
    overlap = load_topology(two_p_one_d(tmp_path, dp_ep, "[mlx5_5:1, mlx5_6:1]"))
    assert kv_only_rails(overlap, "h200-e") is None
    assert kv_only_rails(load_topology(two_p_one_d(tmp_path, dp_ep, "all")), "h200-e") is None
    nccl_only = f'{{NCCL_IB_HCA: "{six}"}}'
    deepep = load_topology(two_p_one_d(tmp_path, nccl_only, "[mlx5_6:1, mlx5_7:1]"))
    assert kv_only_rails(deepep, "h200-e") is None
    excluding = '{NCCL_IB_HCA: "^mlx5_6,mlx5_7", NVSHMEM_HCA_LIST: "mlx5_0:1"}'
    assert (
        kv_only_rails(load_topology(two_p_one_d(tmp_path, excluding, "[mlx5_6:1]")), "h200-e")
        is None
    )


def test_counters_of_the_kv_only_rails_are_named() -> None:
    rails = {"hgx-a": ["mlx5_6", "mlx5_7"], "hgx-b": ["mlx5_6"]}
    plan = RunPlan(rdma_roles=ROLES, kv_endpoints=[PREFILL, DECODE], kv_rails=rails)
    coord = _gated(plan, 1, "rc_mlx5/mlx5_6:1")
    _rdma_evidence(coord)
    assert coord.record.verdict == (True, "gate passed")
    assert coord.transport_note is not None
    assert coord.transport_note.endswith(
        "hgx-b received 4 B (the rails that carry only KV: hgx-a mlx5_6,mlx5_7; hgx-b mlx5_6)"
    )


def test_the_deploy_reads_the_counters_of_the_kv_only_rails() -> None:
    # a first release: no host has a release store yet
    h20 = load_topology(str(REPO / "topologies/h20-v4flash-1p1d-2node.yml"))
    plan = run_plan({h: {} for h in h20.hosts}, {h: "r1" for h in h20.hosts}, h20)
    assert _counter_devices(h20, "h20-b", plan) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert plan.kv_rails["h20-b"] == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    seed = load_topology(str(REPO / "topologies/h200-dsv32-2p1d.yml"))
    plan = run_plan({h: {} for h in seed.hosts}, {h: "r1" for h in seed.hosts}, seed)
    assert _counter_devices(seed, "h200-e", plan) == list(seed.hosts["h200-e"].rdma)
    assert "h200-e" not in plan.kv_rails


class _Host:
    """A pyinfra host: shell commands run in `sh` with `path`, the agent's `hgxserve release`
    in this process."""

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self.said: list[str] = []

    def run_shell_command(self, command: str) -> tuple[bool, Any]:
        argv = shlex.split(command)
        if argv[0].endswith("/hgxserve"):
            result = CliRunner().invoke(release, argv[2:])
            out, err, ok = result.stdout, result.stderr, result.exit_code == 0
        else:
            env = {**os.environ, "PATH": self.path}
            proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
            out, err, ok = proc.stdout, proc.stderr, proc.returncode == 0
        return ok, SimpleNamespace(stdout_lines=out.splitlines(), stderr_lines=err.splitlines())

    def log_styled(self, message: str, **_: Any) -> None:
        self.said.append(message)


def test_the_step_reads_the_tables_and_keeps_the_transport_in_the_record(
    journal_path: str, tmp_path: Path
) -> None:
    store = Store(str(tmp_path / "lib"))
    (store.release_dir("r1") / "tree").mkdir(parents=True)
    store.note_observed("r1", DECODE.unit, {"start_s": 4.2})
    coord = Coordination(RunPlan(kv_endpoints=[PREFILL, DECODE]))
    host = _Host("hgx-b", journal_path)
    assert read_kv_path(None, host, coord, "r1", str(store.root))  # type: ignore[arg-type]
    assert host.said[0] == (
        "UCX protocol-selection tables of the KV engines' current run: hgxserve-decode-0.service 1"
    )
    assert [t.lanes for t in coord.record.kv_proto["hgx-b"][DECODE.unit].tables] == [
        ["rc_mlx5/mlx5_0:1"]
    ]
    assert store.observed("r1")[DECODE.unit] == {
        "start_s": 4.2,
        "kv_transport": "rdma",
        "kv_lanes": ["rc_mlx5/mlx5_0:1"],
    }


def test_the_record_says_tcp_rdma_or_none() -> None:
    tcp = UnitRead([table("c inter-node cfg#1", "tcp/eth0")], whole_run=True)
    assert unit_record(tcp) == {"kv_transport": "tcp", "kv_lanes": ["tcp/eth0"]}
    local = UnitRead([table("c intra-node cfg#0", "cuda_ipc/cuda")], whole_run=True)
    assert unit_record(local) == {"kv_transport": "none", "kv_lanes": []}
    result = CliRunner().invoke(release, ["kv-transport", "r1", "--record", "[1]"])
    assert result.exit_code != 0 and "--record: not a unit -> transport mapping" in result.output
