"""ProxyConfig parsing: every problem reported with its JSON path; `proxy check` exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hgxserve.base.defaults import DRAIN_MARGIN_S, DRAIN_OUTPUT_TOKENS
from hgxserve.base.sizes import parse_size
from hgxserve.proxy.body import estimate_prompt_tokens
from hgxserve.proxy.config import (
    ProxyConfig,
    ProxyConfigError,
    drain_bound,
    load_proxy_config,
    parse_proxy_config,
    restart_needed,
)

HGXSERVE = Path(sys.executable).with_name("hgxserve")
SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "topology.schema.json"


def test_full_config_parses() -> None:
    cfg = parse_proxy_config(
        {
            "listen": {"host": "0.0.0.0", "port": 8000},
            "protocol": "sglang",
            "served_model_name": "DeepSeek-V4-Flash",
            "pd_groups": [
                {
                    "name": "pd-0",
                    "prefill": [{"url": "http://10.0.0.11:30000", "bootstrap_port": 8998}],
                    "decode": ["http://10.0.0.12:30000"],
                }
            ],
            "combined": ["http://10.0.0.13:8000/"],
            "routing": {"pd_min_prompt_tokens": 2049, "bytes_per_token": 3.5},
            "limits": {"max_body_bytes": 1048576},
            "health": {"interval_s": 5},
            "auth": {"api_key_file": "/run/credentials/hgxserve-proxy.service/api-key"},
        }
    )
    assert cfg.pd_groups[0].prefill[0].bootstrap_host == "10.0.0.11"
    assert cfg.pd_groups[0].prefill[0].bootstrap_port == 8998
    assert cfg.combined[0].url == "http://10.0.0.13:8000"
    assert cfg.routing.pd_min_prompt_tokens == 2049 and cfg.health.interval_s == 5


def test_every_error_is_reported_with_its_path() -> None:
    with pytest.raises(ProxyConfigError) as err:
        parse_proxy_config(
            {
                "protocol": "nixl",
                "pd_groups": [{"prefill": ["10.0.0.1:8100"], "decode": []}],
                "routing": {"pd_min_prompt_tokens": -1, "colour": 1},
            }
        )
    text = str(err.value)
    for expected in (
        "$.protocol: must be one of vllm-nixl, sglang",
        "$.served_model_name: must be a non-empty string",
        "$.pd_groups[0].prefill[0].url: must be an http(s) URL",
        "$.pd_groups[0].decode: must list at least one decode engine URL",
        "$.routing.pd_min_prompt_tokens: must be an integer >= 0",
        "$.routing.colour: unknown key",
    ):
        assert expected in text


def test_short_prompt_bucket_needs_combined() -> None:
    with pytest.raises(ProxyConfigError, match="short prompts need combined engines"):
        parse_proxy_config(
            {
                "protocol": "vllm-nixl",
                "served_model_name": "m",
                "pd_groups": [{"prefill": ["http://a:1"], "decode": ["http://b:2"]}],
                "routing": {"pd_min_prompt_tokens": 100},
            }
        )


def test_check_command(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            {
                "protocol": "vllm-nixl",
                "served_model_name": "m",
                "combined": ["http://127.0.0.1:8100"],
            }
        )
    )
    out = subprocess.run(
        [str(HGXSERVE), "proxy", "check", "--config", str(good)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "ok: vllm-nixl" in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"protocol": "vllm-nixl",\n "served_model_name": }')
    out = subprocess.run(
        [str(HGXSERVE), "proxy", "check", "--config", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 1 and f"{bad}:2:" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(ProxyConfigError, match="cannot read"):
        load_proxy_config(tmp_path / "missing.json")


def test_prompt_estimate() -> None:
    assert estimate_prompt_tokens({"prompt": "x" * 400}, 4.0) == 100
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}, 4.0) == 3
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 80}]}]}
    assert estimate_prompt_tokens(chat, 4.0) == 20


def test_front_door_limits_and_keys_are_checked(tmp_path: Path) -> None:
    base = {"protocol": "vllm-nixl", "served_model_name": "m", "combined": ["http://127.0.0.1:1"]}
    with pytest.raises(ProxyConfigError) as err:
        parse_proxy_config(
            {
                **base,
                "limits": {
                    "max_connections": 0,
                    "header_timeout_s": -1,
                    "max_body_bytes": 10_000_000,
                    "max_buffered_body_bytes": 5_000_000,
                },
                "auth": {"upstream_api_key_file": "relative/key"},
            }
        )
    text = str(err.value)
    assert "$.limits.max_connections: must be an integer >= 1" in text
    assert "$.limits.header_timeout_s: must be a number >= 0.01" in text
    assert "$.limits.max_buffered_body_bytes: must be at least max_body_bytes" in text
    assert "$.auth.upstream_api_key_file: must be an absolute path" in text
    key = tmp_path / "engine-key"
    key.touch(mode=0o600)  # a key file is private (hgxserve.base.apikeys)
    key.write_text("line one of the key\r\nInjected: header-0123456789\n")
    config = tmp_path / "p.json"
    config.write_text(json.dumps({**base, "auth": {"upstream_api_key_file": str(key)}}))
    out = subprocess.run(
        [str(HGXSERVE), "proxy", "check", "--config", str(config)], capture_output=True, text=True
    )
    assert out.returncode == 1 and "printable ASCII" in out.stderr, "it would split a header"
    key.write_text("engine-k3y-0123456789abcdef0123456789\n")
    out = subprocess.run(
        [str(HGXSERVE), "proxy", "check", "--config", str(config)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "engines: keyed" in out.stdout and "engine-k3y" not in out.stdout
    assert "2048 requests in flight" in out.stdout


def test_defaults_are_the_topology_schema_defaults() -> None:
    """Each setting the topology schema gives a default for has that default here too, in the
    dataclasses and in a parsed file that leaves it out."""
    props = json.loads(SCHEMA.read_text())["$defs"]["proxy"]["properties"]
    defaults = {key: prop["default"] for key, prop in props.items() if "default" in prop}
    # `kind` picks the proxy implementation: not a setting of this one
    assert set(defaults) == {
        "listen",
        "kind",
        "pd_min_prompt_tokens",
        "max_body",
        "timeout_s",
        "drain_tpot_ms",
        "drain_max_s",
    }
    parsed = parse_proxy_config(
        {"protocol": "vllm-nixl", "served_model_name": "m", "combined": ["http://127.0.0.1:1"]}
    )
    for cfg in (ProxyConfig("vllm-nixl", "m"), parsed):
        assert f"{cfg.host}:{cfg.port}" == defaults["listen"]
        assert cfg.routing.pd_min_prompt_tokens == defaults["pd_min_prompt_tokens"]
        assert cfg.limits.max_body_bytes == parse_size(defaults["max_body"]) == 16 << 20
        assert cfg.limits.prefill_timeout_s == defaults["timeout_s"]
        assert cfg.limits.read_timeout_s == defaults["timeout_s"]
        # the drain bound of the longest default answer at the schema's TPOT and cap
        assert cfg.limits.drain_timeout_s == drain_bound(
            DRAIN_OUTPUT_TOKENS, defaults["drain_tpot_ms"], defaults["drain_max_s"]
        )


def test_drain_bound_is_output_tokens_times_tpot_plus_margin_capped() -> None:
    # 256 tokens at 40 ms: 10.24 s of decoding, plus the margin
    assert drain_bound(256, 40, 900) == round(10.24 + DRAIN_MARGIN_S, 3)
    # 8192 tokens at 40 ms: 327.68 s, plus the margin
    assert drain_bound(8192, 40, 900) == round(327.68 + DRAIN_MARGIN_S, 3)
    # a 128K context at 40 ms would be 87 minutes: the cap holds it
    assert drain_bound(131072, 40, 900) == 900
    assert drain_bound(131072, 40, 1800) == 1800


def test_drain_timeout_is_read_and_checked() -> None:
    base = {"protocol": "vllm-nixl", "served_model_name": "m", "combined": ["http://a:1"]}
    cfg = parse_proxy_config({**base, "limits": {"drain_timeout_s": 12.5}})
    assert cfg.limits.drain_timeout_s == 12.5
    with pytest.raises(ProxyConfigError, match=r"drain_timeout_s: must be a number >= 0"):
        parse_proxy_config({**base, "limits": {"drain_timeout_s": -1}})


def test_restart_needed_names_what_a_reload_cannot_change() -> None:
    base = {"protocol": "vllm-nixl", "served_model_name": "m", "combined": ["http://a:1"]}
    cfg = parse_proxy_config(base)
    routes = parse_proxy_config({**base, "combined": ["http://a:1", "http://b:2"]})
    limits = parse_proxy_config({**base, "limits": {"max_in_flight": 3, "max_body_bytes": 4096}})
    assert restart_needed(cfg, routes) == [] and restart_needed(cfg, limits) == []
    moved = parse_proxy_config({**base, "listen": {"host": "127.0.0.1", "port": 9000}})
    assert restart_needed(cfg, moved) == ["host", "port"]
    keyed = parse_proxy_config({**base, "auth": {"api_key_file": "/run/k"}})
    assert restart_needed(cfg, keyed) == ["api_key_file"]
    pooled = parse_proxy_config({**base, "limits": {"upstream_max_idle": 2}})
    assert restart_needed(cfg, pooled) == ["limits.upstream_max_idle"]
