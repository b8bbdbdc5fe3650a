"""ports.py: the one port scheme (HTTP, VLLM_PORT, side channel per DP rank, bootstrap, rpc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.topology import load_topology
from hgxserve.topology.ports import (
    Listener,
    engine_bind,
    engine_url,
    listeners_by_host,
    setting_path,
    side_channel_host,
    side_channel_ports,
)

REPO = Path(__file__).resolve().parents[2]


def _topo(rel: str):  # type: ignore[no-untyped-def]
    return load_topology(REPO / rel)


def _ports(listeners: list[Listener]) -> list[tuple[int, str, str, str]]:
    return [(li.port, li.bind, li.owner, li.what) for li in listeners]


def test_same_host_pd_listeners() -> None:
    topo = _topo("topologies/h20-v4flash-4p4d.yml")
    assert _ports(listeners_by_host(topo)["h20-a"]) == [
        (22, "0.0.0.0", "sshd", "ssh"),
        (8000, "0.0.0.0", "proxy", "OpenAI API"),
        (8100, "127.0.0.1", "prefill-0", "HTTP API"),
        (20000, "0.0.0.0", "prefill-0", "VLLM_PORT"),
        (5559, "127.0.0.1", "prefill-0", "NIXL side channel (dp rank 0)"),
        # KV events (policy kv-events, the default): the publisher binds every address (the
        # engines bind only a wildcard PUB endpoint), the replay listener beside the API
        (28100, "0.0.0.0", "prefill-0", "KV events (dp rank 0)"),
        (29100, "127.0.0.1", "prefill-0", "KV events replay (dp rank 0)"),
        (8200, "127.0.0.1", "decode-0", "HTTP API"),
        (30000, "0.0.0.0", "decode-0", "VLLM_PORT"),
        (5659, "127.0.0.1", "decode-0", "NIXL side channel (dp rank 0)"),
        (28200, "0.0.0.0", "decode-0", "KV events (dp rank 0)"),
        (29200, "127.0.0.1", "decode-0", "KV events replay (dp rank 0)"),
    ]


def test_multi_host_dp_side_channels_are_base_plus_rank_per_host() -> None:
    topo = _topo("topologies/h200-dsv32-2p1d.yml")
    prefill = topo.engines["prefill-0"]
    assert side_channel_ports(prefill, "h200-a") == [(0, 5600), (1, 5601), (2, 5602), (3, 5603)]
    assert side_channel_ports(prefill, "h200-b") == [(4, 5604), (5, 5605), (6, 5606), (7, 5607)]
    assert side_channel_host(topo, prefill, "h200-a") == "10.0.1.11"
    assert side_channel_host(topo, prefill, "h200-b") == "10.0.1.12"
    by_host = listeners_by_host(topo)
    head = _ports(by_host["h200-a"])
    assert (13345, "0.0.0.0", "prefill-0", "data-parallel RPC") in head
    assert (8100, "0.0.0.0", "prefill-0", "HTTP API") in head
    # the HTTP API and the rpc port live on the head only
    assert [li for li in by_host["h200-b"] if li.what in ("HTTP API", "data-parallel RPC")] == []
    assert [li.port for li in by_host["h200-f"] if li.owner == "decode-0"] == [
        5604,
        5605,
        5606,
        5607,
        # KV events of DP ranks 4-7, publisher and replay, each base + rank on this host
        *(p for rank in range(4, 8) for p in (28200 + rank, 29200 + rank)),
        13346,  # the engine's watcher, on every host of a multi-node engine
    ]


def test_side_channel_auto_is_loopback_on_one_host_and_routable_across() -> None:
    same = _topo("tests/topology/valid/same-host-pd-loopback.yml")
    assert side_channel_host(same, same.engines["prefill-0"], "h-a") == "127.0.0.1"
    cross = _topo("tests/topology/valid/multi-host-dp-ep.yml")
    # h-c advertises its dedicated side-channel address, not its SSH address
    assert side_channel_host(cross, cross.engines["decode-0"], "h-c") == "192.168.7.13"
    demo = _topo("topologies/demo/demo-pd.yml")
    assert side_channel_host(demo, demo.engines["prefill-0"], "hgx-a") == "10.77.0.11"


def test_sglang_bootstrap_on_prefill_head_only() -> None:
    topo = _topo("tests/topology/valid/sglang-pd-mooncake.yml")
    by_host = listeners_by_host(topo)
    assert (8998, "0.0.0.0", "prefill-0", "SGLang bootstrap") in _ports(by_host["h-a"])
    assert all(li.what != "SGLang bootstrap" for li in by_host["h-b"])
    assert all("side channel" not in li.what for li in by_host["h-a"] + by_host["h-b"])


def test_engine_bind_and_url() -> None:
    topo = _topo("topologies/demo/demo-pd.yml")
    prefill, decode, combined = (topo.engines[n] for n in ("prefill-0", "decode-0", "combined-0"))
    # the proxy is on hgx-c: only the combined engine shares its host
    assert engine_bind(topo, combined) == "127.0.0.1"
    assert engine_bind(topo, prefill) == "0.0.0.0"
    assert engine_url(topo, combined) == "http://127.0.0.1:8300"
    assert engine_url(topo, prefill) == "http://10.77.0.11:8100"
    assert engine_url(topo, decode) == "http://10.77.0.12:8200"


@pytest.mark.parametrize(
    ("engine", "keys", "path"),
    [
        ("decode-0", ("tp",), ("engines", "decode-0", "tp")),
        ("decode-0", ("args", "kv_cache_dtype"), ("defaults", "args", "kv_cache_dtype")),
        (
            "decode-0",
            ("kv", "side_channel", "port"),
            ("engines", "decode-0", "kv", "side_channel", "port"),
        ),
        ("decode-0", ("rpc_port",), ("engines", "decode-0")),
        ("decode-0", ("kv", "bootstrap_port"), ("engines", "decode-0", "kv")),
    ],
)
def test_setting_path_points_where_the_value_is_written(
    engine: str, keys: tuple[str, ...], path: tuple[str, ...]
) -> None:
    topo = _topo("topologies/h20-v4flash-4p4d.yml")
    assert setting_path(topo, engine, *keys) == path
