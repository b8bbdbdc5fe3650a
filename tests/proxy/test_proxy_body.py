"""The request-body splice the proxy uses to forward client bytes without re-encoding them."""

from __future__ import annotations

import json

from hgxserve.proxy.body import new_request_id, strip_transfer_fields, with_fields


def test_with_fields_appends_to_the_clients_bytes() -> None:
    raw = b'{"model": "m", "prompt": "caf\\u00e9 \xe2\x82\xac", "stream": true}\n'
    body = json.loads(raw)
    out = with_fields(raw, body, {"kv_transfer_params": {"remote_block_ids": [1, 2]}})
    assert out.startswith(raw[: raw.rfind(b"}")]), "client bytes kept as they came"
    assert json.loads(out) == {**body, "kv_transfer_params": {"remote_block_ids": [1, 2]}}


def test_with_fields_reencodes_when_a_key_exists_or_body_is_empty() -> None:
    raw = b'{"kv_transfer_params": {"old": 1}, "x": 2}'
    out = with_fields(raw, json.loads(raw), {"kv_transfer_params": {"new": 1}})
    assert out.count(b"kv_transfer_params") == 1
    assert json.loads(out) == {"kv_transfer_params": {"new": 1}, "x": 2}
    assert json.loads(with_fields(b"{}", {}, {"a": 1})) == {"a": 1}
    bom = b"\xef\xbb\xbf" + b'{"x": 1}'
    assert json.loads(with_fields(bom, json.loads(bom), {"a": 1})) == {"x": 1, "a": 1}


def test_request_ids_are_128_bit_hex_and_distinct() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_transfer_fields_inside_vllm_xargs_are_stripped() -> None:
    """vLLM passes `vllm_xargs` on to the request's extra args: a client's
    kv_transfer_params there would tell a decode where to pull KV from."""
    body = {"prompt": "x", "vllm_xargs": {"kv_transfer_params": {"remote_host": "6.6.6.6"},
                                         "bootstrap_host": "6.6.6.6", "top_k_sink": 3}}  # fmt: skip
    raw, clean = strip_transfer_fields(json.dumps(body).encode(), body)
    assert clean == {"prompt": "x", "vllm_xargs": {"top_k_sink": 3}}
    assert json.loads(raw) == clean
    plain = {"prompt": "x", "vllm_xargs": {"a": 1}}
    assert strip_transfer_fields(b"same bytes", plain) == (b"same bytes", plain)
