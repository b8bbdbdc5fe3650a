"""KV-event publishers in the port plan: one publisher and one replay listener per DP rank, on
the host running the rank, ports derived from the engine's port unless written, only for engines
the hgxserve proxy routes with policy kv-events; the firewall lets the proxy host reach them."""

from __future__ import annotations

from pathlib import Path

from hgxserve.topology import check_topology, load_topology
from hgxserve.topology.firewall import access_plan
from hgxserve.topology.model import Topology
from hgxserve.topology.placement import proxy_tokenizer
from hgxserve.topology.ports import (
    KV_EVENTS,
    kv_event_endpoints,
    kv_events_base_ports,
    listeners_by_host,
    publishes_kv_events,
)

REPO = Path(__file__).resolve().parents[2]

BASE = """\
name: kv
hosts:
  h-a: {address: 10.0.0.11, gpu: H200}
  h-b: {address: 10.0.0.12, gpu: H200}
model: {name: m, served_name: m, path: /models/m, source: {local: {path: /models/m}}}
defaults:
  engine: ENGINE
  runtime: {venv: /opt/engine}
  args: {max_num_seqs: 8, max_model_len: 4096}
engines:
"""


def _load(tmp_path: Path, text: str, engine: str = "vllm") -> Topology:
    path = tmp_path / "kv.yml"
    path.write_text(BASE.replace("ENGINE", engine) + text)
    return load_topology(path)


def _kv_listeners(topo: Topology, host: str) -> list[tuple[int, str, str, str]]:
    return [
        (li.port, li.bind, li.owner, li.what)
        for li in listeners_by_host(topo)[host]
        if li.what.startswith(KV_EVENTS)
    ]


def test_vllm_dp_ranks_each_get_a_publisher_and_a_replay_on_their_host() -> None:
    topo = load_topology(REPO / "topologies/demo/demo-multinode.yml")
    engine = topo.engines["combined-0"]
    assert kv_events_base_ports(engine) == (28300, 29300)
    # DP rank 0 on hgx-a (head), rank 1 on hgx-b; a multi-host engine's replay binds every address
    assert _kv_listeners(topo, "hgx-a") == [
        (28300, "0.0.0.0", "combined-0", "KV events (dp rank 0)"),
        (29300, "0.0.0.0", "combined-0", "KV events replay (dp rank 0)"),
    ]
    assert _kv_listeners(topo, "hgx-b") == [
        (28301, "0.0.0.0", "combined-0", "KV events (dp rank 1)"),
        (29301, "0.0.0.0", "combined-0", "KV events replay (dp rank 1)"),
    ]
    assert _kv_listeners(topo, "hgx-c") == []  # the proxy's host runs no rank
    assert kv_event_endpoints(topo, engine) == (
        ["tcp://10.77.0.11:28300", "tcp://10.77.0.12:28301"],
        ["tcp://10.77.0.11:29300", "tcp://10.77.0.12:29301"],
    )


def test_sglang_offsets_by_the_attention_dp_rank() -> None:
    topo = load_topology(REPO / "topologies/h200-dsv32-sglang-dp8.yml")
    ports = [p for p, _, _, what in _kv_listeners(topo, "h200-a") if "replay" not in what]
    assert ports == list(range(50000, 50008))  # port 30000 + 20000, + rank 0..7


def test_written_ports_win_and_derived_ones_stay_below_65536(tmp_path: Path) -> None:
    topo = _load(
        tmp_path,
        "  c-0: {role: combined, place: {h-a: [0]}, tp: 1, port: 8100,"
        " kv_events: {port: 40000, replay_port: 40100}}\n"
        "  c-1: {role: combined, place: {h-a: [1, 2]}, tp: 1, dp: 2, port: 50000,"
        " args: {disable_nccl_for_dp_synchronization: false}}\n"
        "proxy: {host: h-a, combined: [c-0, c-1]}\n",
    )
    assert kv_events_base_ports(topo.engines["c-0"]) == (40000, 40100)
    # 50000 + 20000 would pass 65535: the offset goes the other way
    assert kv_events_base_ports(topo.engines["c-1"]) == (30000, 29000)
    assert check_topology(topo.source_file).errors == []


def test_a_user_port_on_a_derived_kv_port_is_a_clash(tmp_path: Path) -> None:
    path = tmp_path / "clash.yml"
    path.write_text(
        BASE.replace("ENGINE", "vllm")
        + "  c-0: {role: combined, place: {h-a: [0]}, tp: 1, port: 8100}\n"
        "  c-1: {role: combined, place: {h-a: [1]}, tp: 1, port: 28100}\n"
        "proxy: {host: h-a, combined: [c-0, c-1]}\n"
    )
    clashes = [p for p in check_topology(path).problems if p.rule == "port-clash"]
    assert [p.message for p in clashes] == [
        "port 28100 on h-a is used by both c-0 KV events (dp rank 0) and c-1 HTTP API; "
        "give each listener its own port (KV-event ports are the engine's port + 20000 and + 21000 "
        "unless kv_events.port and kv_events.replay_port say otherwise, each + the DP rank)"
    ]


def test_only_kv_events_routes_publish(tmp_path: Path) -> None:
    topo = _load(
        tmp_path,
        "  p-0: {role: prefill, place: {h-a: [0]}, tp: 1, port: 8100,"
        " kv: {connector: nixl, side_channel: {port: 5600}}}\n"
        "  d-0: {role: decode, place: {h-b: [0]}, tp: 1, port: 8200, kv: {connector: nixl}}\n"
        "  c-0: {role: combined, place: {h-a: [1]}, tp: 1, port: 8300}\n"
        "proxy:\n"
        "  host: h-a\n"
        "  routes: [{prefill: [p-0], decode: [d-0], policy: approximate}]\n"
        "  combined: [c-0]\n"
        "  pd_min_prompt_tokens: 64\n",
    )
    published = {n for n, e in topo.engines.items() if publishes_kv_events(topo, e)}
    assert published == {"c-0"}  # routing.policy kv-events (the default) for the combined
    assert _kv_listeners(topo, "h-b") == []
    assert topo.proxy is not None and topo.proxy.route_policy(topo.proxy.routes[0]) == "approximate"


def test_router_kinds_never_publish(tmp_path: Path) -> None:
    topo = _load(
        tmp_path,
        "  c-0: {role: combined, place: {h-a: [0]}, tp: 1, port: 8100}\n"
        "proxy: {host: h-a, kind: vllm-router, combined: [c-0]}\n",
    )
    assert not publishes_kv_events(topo, topo.engines["c-0"])


def test_firewall_lets_the_proxy_host_and_the_engine_hosts_reach_kv_ports() -> None:
    topo = load_topology(REPO / "topologies/demo/demo-multinode.yml")
    for host, own in (("hgx-a", "10.77.0.11"), ("hgx-b", "10.77.0.12")):
        kv = [a for a in access_plan(topo, host) if a.listener.what.startswith(KV_EVENTS)]
        assert len(kv) == 2
        for item in kv:
            assert {s.address for s in item.sources} == {"10.77.0.11", "10.77.0.12", "10.77.0.13"}
            assert not item.controller  # the controller never subscribes
            assert own in {s.address for s in item.sources}


def test_tokenizer_from_the_weights_only_where_the_proxy_runs_an_engine(tmp_path: Path) -> None:
    # demo-pd's proxy runs beside combined-0 (its weights are there); it says tokenizer: none
    text = (REPO / "topologies/demo/demo-pd.yml").read_text()
    path = tmp_path / "beside.yml"
    path.write_text(
        text.replace("    tokenizer: none\n", "").replace("    policy: least-outstanding\n", "")
    )
    beside = load_topology(path)
    assert proxy_tokenizer(beside)[0] == "/models/tiny"
    assert proxy_tokenizer(load_topology(REPO / "topologies/demo/demo-pd.yml"))[0] is None
    apart = load_topology(REPO / "topologies/demo/demo-multinode.yml")
    directory, why = proxy_tokenizer(apart)
    assert directory is None
    assert "runs no engine" in why and "approximate" in why
    off = _load(
        tmp_path,
        "  c-0: {role: combined, place: {h-a: [0]}, tp: 1, port: 8100}\n"
        "proxy: {host: h-a, combined: [c-0], routing: {tokenizer: none}}\n",
    )
    assert proxy_tokenizer(off) == (
        None,
        "proxy.routing.tokenizer is none: approximate character index",
    )


def test_routing_bounds_are_schema_errors(tmp_path: Path) -> None:
    topo_text = (
        "  c-0: {role: combined, place: {h-a: [0]}, tp: 1, port: 8100}\n"
        "proxy: {host: h-a, combined: [c-0], routing: {sticky_max_wait_ratio: 0.5,"
        " approx_ttl_s: 0, policy: nearest}}\n"
    )
    path = tmp_path / "bad.yml"
    path.write_text(BASE.replace("ENGINE", "vllm") + topo_text)
    paths = {p.path for p in check_topology(path).problems}
    assert {
        ("proxy", "routing", "sticky_max_wait_ratio"),
        ("proxy", "routing", "approx_ttl_s"),
        ("proxy", "routing", "policy"),
    } <= paths


def test_defaults_kv_events_apply_and_an_engine_replaces_them_whole(tmp_path: Path) -> None:
    path = tmp_path / "defaults.yml"
    path.write_text(
        BASE.replace("ENGINE", "vllm").replace(
            "engines:\n", "  kv_events: {port: 41000, replay_port: 42000}\nengines:\n"
        )
        + "  c-0: {role: combined, place: {h-a: [0]}, tp: 1, port: 8100}\n"
        "  c-1: {role: combined, place: {h-b: [0]}, tp: 1, port: 8200,"
        " kv_events: {port: 43000}}\n"
        "proxy: {host: h-a, combined: [c-0, c-1]}\n"
    )
    topo = load_topology(path)
    assert kv_events_base_ports(topo.engines["c-0"]) == (41000, 42000)
    # c-1's own object replaces the defaults' whole: its replay port is derived again
    assert kv_events_base_ports(topo.engines["c-1"]) == (43000, 29200)
