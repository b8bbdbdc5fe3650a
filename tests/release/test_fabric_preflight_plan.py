"""The fabric preflight's pure parts (hgxserve.release.fabric): which hosts and rails it
measures, the commands, and the verdict naming host, rail and figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.parsers.fabric import AllReduceReport, BwReport, PortReading
from hgxserve.release.fabric import (
    FabricRun,
    FabricScope,
    Pair,
    Span,
    allreduce_command,
    allreduce_measurement,
    client_command,
    fabric_scope,
    link_findings,
    links_command,
    measurement,
    server_command,
)
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
GID = "0000:0000:0000:0000:0000:ffff:0a4d:000c"


def _topology(tmp_path: Path, replace: dict[str, str]) -> Path:
    text = PD.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "t.yml"
    path.write_text(text)
    return path


RAILS = {
    "hgx-a: {address: 10.77.0.11, gpu: H200, gpus: 8}": (
        "hgx-a: {address: 10.77.0.11, gpu: H200, gpus: 8, rdma: [mlx5_0, mlx5_1]}"
    ),
    "hgx-b: {address: 10.77.0.12, gpu: H200, gpus: 8}": (
        "hgx-b: {address: 10.77.0.12, gpu: H200, gpus: 8, rdma: [mlx5_1, mlx5_2]}"
    ),
}


def test_pd_across_hosts_measures_prefill_to_decode_on_the_rails_both_name(
    tmp_path: Path,
) -> None:
    scope = fabric_scope(load_topology(_topology(tmp_path, RAILS)))
    assert scope is not None
    assert scope.pairs == (Pair("hgx-a", "hgx-b", ("mlx5_1",), "P/D prefill-0 -> decode-0"),)
    assert scope.rails == {"hgx-a": ("mlx5_0", "mlx5_1"), "hgx-b": ("mlx5_1", "mlx5_2")}
    assert scope.servers("hgx-b") == [(18515, "mlx5_1")] and scope.servers("hgx-a") == []
    assert [(p.server, port, rail) for p, port, rail in scope.clients("hgx-a")] == [
        ("hgx-b", 18515, "mlx5_1")
    ]


def test_nothing_to_measure_without_rails_or_with_fabric_off(tmp_path: Path) -> None:
    assert fabric_scope(load_topology(PD)) is None  # demo-pd names no rails
    off = {**RAILS, "warmup:": "gate: {fabric: off}\nwarmup:"}
    assert fabric_scope(load_topology(_topology(tmp_path, off))) is None
    assert load_topology(PD).gate.fabric == "fail"  # the schema's default


def test_an_engine_spanning_hosts_measures_its_head_to_each_other_host() -> None:
    from hgxserve.release.fabric import _engine_pairs

    class _Engine:
        head, hosts = "n1", ["n1", "n2", "n3"]

    class _Topo:
        engines = {"big": _Engine()}

    assert _engine_pairs(_Topo()) == [  # type: ignore[arg-type]
        ("n1", "n2", "engine big spans hosts"),
        ("n1", "n3", "engine big spans hosts"),
    ]


def _port(**kw: str) -> PortReading:
    base = {
        "device": "mlx5_1",
        "port": "1",
        "state": "4: ACTIVE",
        "rate": "400 Gb/sec (4X NDR)",
        "link_layer": "Ethernet",
        "gid": GID,
    }
    base.update(kw)
    from hgxserve.parsers.fabric import port_state

    base["state"] = port_state(base["state"])
    return PortReading(**base)


def test_link_findings_name_host_rail_and_what_is_wrong() -> None:
    assert link_findings("hgx-b", ["mlx5_1"], {"mlx5_1/1": _port()}, "H200") == []
    down = link_findings("hgx-b", ["mlx5_1"], {"mlx5_1/1": _port(state="1: DOWN")}, "H200")
    assert down == ["hgx-b rail mlx5_1 port 1 is DOWN (sysfs state), not ACTIVE"]
    slow = link_findings(
        "hgx-b", ["mlx5_1"], {"mlx5_1/1": _port(rate="200 Gb/sec (4X HDR)")}, "H200"
    )
    assert slow == [
        "hgx-b rail mlx5_1 port 1 links at 200 Gb/sec (4X HDR), below the 400 Gb/s a H200 "
        "host's rail runs at"
    ]
    no_gid = link_findings(
        "hgx-b",
        ["mlx5_1"],
        {"mlx5_1/1": _port(gid="0000:0000:0000:0000:0000:0000:0000:0000")},
        "H200",
    )
    assert "has no GID at index 3" in no_gid[0]
    assert link_findings("hgx-b", ["mlx5_9"], {"mlx5_1/1": _port()}, "H200") == [
        "hgx-b rail mlx5_9 has no port under the RDMA sysfs (no such device)"
    ]
    # H20 rails run at 200 Gb/s (seed 003: 4 x 200 Gb/s per side)
    h20 = {"mlx5_1/1": _port(rate="200 Gb/sec (4X HDR)")}
    assert link_findings("n", ["mlx5_1"], h20, "H20") == []
    # a kind without a seed figure is held to its own port's rate
    assert link_findings("n", ["mlx5_1"], h20, "H100") == []
    assert link_findings("hgx-b", ["mlx5_1"], None, "H200") == [
        "hgx-b: its RDMA ports could not be read"
    ]


PAIR = Pair("hgx-a", "hgx-b", ("mlx5_0",), "P/D p -> d")


@pytest.mark.parametrize(
    ("avg", "short"),
    [(388.1, None), (320.0, None), (194.0, "194 Gb/s average, below 320 Gb/s")],
)
def test_a_measurement_below_the_floor_names_both_hosts_rail_and_figure(
    avg: float, short: str | None
) -> None:
    out = measurement(PAIR, "mlx5_0", BwReport(65536, 5000, avg, avg, 0.7), (400.0, 400.0))
    assert out["average_gbps"] == avg and out["floor_gbps"] == 320.0
    if short is None:
        assert "shortfall" not in out
    else:
        assert out["shortfall"] == (
            f"ib_write_bw hgx-a -> hgx-b rail mlx5_0: {short} (0.8 x the 400 Gb/s rail)"
        )


def test_a_run_that_measured_nothing_is_a_shortfall_with_its_last_line() -> None:
    out = measurement(PAIR, "mlx5_0", None, (400.0, None), "rc 1: Couldn't connect to x:1")
    assert out["shortfall"] == (
        "ib_write_bw hgx-a -> hgx-b rail mlx5_0 measured nothing: rc 1: Couldn't connect to x:1"
    )
    assert out["floor_gbps"] == 320.0  # from the end whose rate is known


def test_the_record_keeps_links_figures_and_verdict() -> None:
    scope = FabricScope(
        {"hgx-a": ("mlx5_0",), "hgx-b": ("mlx5_0",)},
        (PAIR,),
        {
            "hgx-a": "H200",
            "hgx-b": "H200",
        },
    )
    run = FabricRun(scope, "fail")
    run.links = {
        "hgx-a": {"mlx5_0/1": _port(device="mlx5_0")},
        "hgx-b": {"mlx5_0/1": _port(device="mlx5_0", state="1: DOWN")},
    }
    run.bandwidth.append(measurement(PAIR, "mlx5_0", None, (400.0, 400.0), "rc 1: down"))
    record = run.record("hgx-b")
    assert record["verdict"] == "short"
    assert record["shortfalls"][0] == "hgx-b rail mlx5_0 port 1 is DOWN (sysfs state), not ACTIVE"
    assert len(record["shortfalls"]) == 2 and record["links"]["mlx5_0/1"]["state"] == "DOWN"
    assert run.roce("hgx-a") == {"mlx5_0": True}
    assert run.judge() is run.shortfalls and len(run.judge()) == 2  # judged once


def test_a_host_that_names_no_rails_has_no_link_findings() -> None:
    scope = FabricScope({"hgx-a": (), "hgx-b": ("mlx5_0",)}, (), {"hgx-a": "H200", "hgx-b": "H200"})
    run = FabricRun(scope, "fail")
    run.links = {"hgx-b": {"mlx5_0/1": _port(device="mlx5_0")}}
    assert run.judge() == [] and run.record("hgx-a")["verdict"] == "pass"


def test_commands_quote_and_bound_what_they_run() -> None:
    links = links_command("/sys/class/infiniband", ["mlx5_0"])
    assert "head -c 200" in links and "gids/3" in links
    server = server_command([(18515, "mlx5_0")], {"mlx5_0": True}, 2)
    assert "setsid timeout 90 ib_write_bw -d mlx5_0 -p 18515 -F --report_gbits -x 3" in server
    client = client_command("mlx5_0", 18515, "10.77.0.12; reboot", False)
    assert "timeout 30 ib_write_bw -d mlx5_0 -p 18515 -F --report_gbits '10.77.0.12; reboot'" in (
        client
    )
    assert client.endswith('echo "##rc $rc"')


MULTI = {
    **{
        old.replace("hgx-a", "hgx-c").replace("10.77.0.11", "10.77.0.13"): new.replace(
            "hgx-a", "hgx-c"
        ).replace("10.77.0.11", "10.77.0.13")
        for old, new in RAILS.items()
        if "hgx-a" in old
    },
    "hgx-b: {address: 10.77.0.12, gpu: H200, gpus: 8}": (
        "hgx-b: {address: 10.77.0.12, gpu: H200, gpus: 8, rdma: [mlx5_0, mlx5_1]}"
    ),
    "place: {hgx-b: [0, 1, 2, 3]}\n    tp: 4": (
        "place: {hgx-b: [0, 1, 2, 3], hgx-c: [4, 5, 6, 7]}\n    tp: 4\n    dp: 2"
    ),
}


def test_a_multi_host_engine_gets_an_all_reduce_across_its_hosts(tmp_path: Path) -> None:
    topo = load_topology(_topology(tmp_path, MULTI))
    scope = fabric_scope(topo)
    assert scope is not None
    assert scope.spans == (Span("decode-0", ("hgx-b", "hgx-c"), 4, ("mlx5_0", "mlx5_1")),)
    command = allreduce_command(
        "/usr/bin/mpirun", scope.spans[0], {h: topo.hosts[h].address for h in topo.hosts}, True
    )
    assert command == (
        "timeout 300 /usr/bin/mpirun --allow-run-as-root -np 2 -H 10.77.0.12:1,10.77.0.13:1 "
        "-x NCCL_IB_HCA=mlx5_0,mlx5_1 -x NCCL_IB_GID_INDEX=3 all_reduce_perf -b 256M -e 256M "
        '-g 4 2>&1; echo "##rc $?"'
    )


SPAN = Span("decode-0", ("hgx-b", "hgx-c"), 4, ("mlx5_0", "mlx5_1"))


def test_an_all_reduce_below_the_floor_names_engine_hosts_and_figure() -> None:
    rates = {"hgx-b": 800.0, "hgx-c": 800.0}  # two 400 Gb/s rails each: 100 GB/s
    ok = allreduce_measurement(SPAN, AllReduceReport(((1, 92.0, 92.0),), 92.0, 0), rates)
    assert "shortfall" not in ok and ok["floor_gbytes"] == 70.0
    short = allreduce_measurement(SPAN, AllReduceReport(((1, 46.0, 46.0),), 46.0, 0), rates)
    assert short["shortfall"] == (
        "NCCL all-reduce of decode-0 across hgx-b+hgx-c (rails mlx5_0,mlx5_1): 46 GB/s bus "
        "bandwidth, below 70 GB/s (0.7 x the slowest host's 800 Gb/s of rails)"
    )
    wrong = allreduce_measurement(SPAN, AllReduceReport(((1, 92.0, 92.0),), 92.0, 3), rates)
    assert "3 out-of-bounds values" in wrong["shortfall"]
    none = allreduce_measurement(SPAN, AllReduceReport((), None, None), rates, "rc 1: boom")
    assert none["shortfall"].endswith("measured nothing: rc 1: boom")
