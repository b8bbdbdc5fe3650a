"""--kv-events-config for vLLM and SGLang engines, and what proxy.json says of KV events and
routing: rendered for engines the hgxserve proxy routes with policy kv-events, never otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, flag_pairs, kv_demo_pd, topology

from hgxserve.base.paths import PROXY_CONFIG
from hgxserve.render import render_host, render_topology
from hgxserve.topology import load_topology

# the routing keys proxy.json carries (docs/proxy.md "KV-aware routing"), every one written out
ROUTING_KEYS = {
    "pd_min_prompt_tokens",
    "policy",
    "tokenizer_dir",
    "inflight_token_weight",
    "sticky_max_wait_ratio",
    "pd_remote_prefill_min_uncached_tokens",
    "pair_max_inflight_tokens",
    "combined_max_inflight_tokens",
    "approx_ttl_s",
}


def _events_flag(topo, host: str, name: str) -> dict | None:  # type: ignore[no-untyped-def]
    unit = next(u for u in render_host(topo, host).units if u.engine == name)
    values = [v for f, v in flag_pairs(unit.argv) if f == "--kv-events-config"]
    assert len(values) <= 1
    return json.loads(values[0]) if values and values[0] else None


def _proxy_json(topo, host: str) -> dict:  # type: ignore[no-untyped-def]
    return json.loads(render_host(topo, host).files[PROXY_CONFIG].content)


def _variant(tmp_path: Path, source: str, old: str, new: str) -> Path:
    text = (ROOT / "topologies" / source).read_text()
    assert old in text
    path = tmp_path / "variant.yml"
    path.write_text(text.replace(old, new))
    return path


def test_vllm_engine_beside_the_proxy_publishes_with_its_replay_on_loopback() -> None:
    topo = kv_demo_pd()
    assert _events_flag(topo, "hgx-c", "combined-0") == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:28300",  # the only PUB form vLLM binds (any address connects out)
        "replay_endpoint": "tcp://127.0.0.1:29300",  # where the HTTP API binds
        "topic": "kv-events",
    }
    # a cross-host engine's replay binds where its API does: every address
    assert _events_flag(topo, "hgx-a", "prefill-0")["replay_endpoint"] == "tcp://0.0.0.0:29100"


def test_sglang_engine_gets_the_same_keys_from_its_own_port() -> None:
    topo = topology("h20-v4flash-sglang-1p1d.yml")
    for host, name, port in (("h20-a", "prefill-0", 30000), ("h20-b", "decode-0", 30001)):
        config = _events_flag(topo, host, name)
        assert config is not None
        assert config["endpoint"] == f"tcp://*:{port + 20000}"
        assert config["replay_endpoint"].endswith(f":{port + 21000}")
        assert config["publisher"] == "zmq" and config["topic"] == "kv-events"
    unit = next(u for u in render_host(topo, "h20-a").units if u.engine == "prefill-0")
    # the JSON reaches ExecStart= through the unit escaping, in one word
    assert '--kv-events-config "{\\"enable_kv_cache_events\\":true,' in unit.content


def test_proxy_json_lists_one_publisher_and_replay_per_dp_rank() -> None:
    config = _proxy_json(topology("h200-dsv32-sglang-dp8.yml"), "h200-a")
    events = config["combined"][0]["kv_events"]
    assert events["publishers"] == [f"tcp://127.0.0.1:{50000 + r}" for r in range(8)]
    assert events["replays"] == [f"tcp://127.0.0.1:{51000 + r}" for r in range(8)]
    assert events["topic"] == "kv-events"


def test_proxy_json_routing_has_every_key_with_the_schema_defaults() -> None:
    routing = _proxy_json(topology("demo/demo-pd.yml"), "hgx-c")["routing"]
    assert set(routing) == ROUTING_KEYS
    assert routing == {
        "pd_min_prompt_tokens": 64,
        "policy": "least-outstanding",  # demo-pd's own (its P/D scenarios measure P/D)
        "tokenizer_dir": None,  # demo-pd says tokenizer: none (its byte tokenizer)
        "inflight_token_weight": 1.0,
        "sticky_max_wait_ratio": 2.0,
        "pd_remote_prefill_min_uncached_tokens": 32,  # demo-pd's own (max_model_len 256)
        "pair_max_inflight_tokens": 0,
        "combined_max_inflight_tokens": 0,
        "approx_ttl_s": 300,
    }


def test_a_proxy_host_without_weights_gets_no_tokenizer_dir() -> None:
    config = _proxy_json(topology("demo/demo-multinode.yml"), "hgx-c")
    assert config["routing"]["tokenizer_dir"] is None
    assert config["combined"][0]["kv_events"]["publishers"] == [
        "tcp://10.77.0.11:28300",
        "tcp://10.77.0.12:28301",
    ]


def test_per_route_and_combined_policies_reach_proxy_json(tmp_path: Path) -> None:
    path = _variant(
        tmp_path,
        "demo/demo-pd.yml",
        "combined: [combined-0]",
        "combined: [combined-0]\n  combined_policy: approximate",
    )
    path.write_text(
        path.read_text().replace(
            "    policy: least-outstanding",
            "    policy: kv-events\n    inflight_token_weight: 0.5\n    approx_ttl_s: 60",
        )
    )
    text = path.read_text().replace(
        "- {prefill: [prefill-0], decode: [decode-0]}",
        "- {prefill: [prefill-0], decode: [decode-0], policy: least-outstanding}",
    )
    path.write_text(text)
    topo = load_topology(path)
    config = _proxy_json(topo, "hgx-c")
    assert config["pd_groups"][0]["policy"] == "least-outstanding"
    assert config["combined_policy"] == "approximate"
    assert config["routing"]["inflight_token_weight"] == 0.5
    assert config["routing"]["approx_ttl_s"] == 60
    # nothing routes with kv-events now: no engine publishes, no endpoint names events
    assert all(
        "kv_events" not in e
        for e in [*config["combined"], *config["pd_groups"][0]["prefill"]]
        + config["pd_groups"][0]["decode"]
    )
    assert _events_flag(topo, "hgx-a", "prefill-0") is None


def test_least_outstanding_renders_no_kv_events_anywhere(tmp_path: Path) -> None:
    path = _variant(
        tmp_path,
        "h20-v4flash-4p4d.yml",
        "  routes:",
        "  routing: {policy: least-outstanding}\n  routes:",
    )
    rendered = render_topology(load_topology(path))
    for host in rendered.values():
        for file_path, item in host.files.items():
            assert "kv-events-config" not in item.content, file_path
            assert "KV events" not in item.content, file_path
    config = json.loads(rendered["h20-a"].files[PROXY_CONFIG].content)
    assert config["routing"]["policy"] == "least-outstanding"
    assert "kv_events" not in json.dumps(config)
