"""The P/D protocols: how one routed request reaches its prefill and decode engines.

vLLM NIXL: prefill gets the body with stream=false, max_tokens=1 and kv_transfer_params
{do_remote_decode: true}; decode gets the original body plus the params prefill returned (or
none: first token was EOS, decode prefills locally). SGLang: prefill and decode get the same body
with bootstrap_host/port/room at once. A route without a prefill is one relayed call.

    resp = await dispatch(relay, "vllm-nixl", call, decision)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from hgxserve.proxy.balancer import Decision, Instance
from hgxserve.proxy.body import compact_json, with_fields
from hgxserve.proxy.frontdoor import Call
from hgxserve.proxy.relay import RETRYABLE_STATUS, Relay, UpstreamUnavailable

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def nixl_prefill_body(body: dict[str, Any]) -> bytes:
    """What a vLLM NIXL prefill gets: one token, not streamed, asked to keep the KV for a
    remote decode."""
    prefill_body = dict(body)
    prefill_body.update(stream=False, max_tokens=1, max_completion_tokens=1)
    prefill_body.pop("stream_options", None)
    prefill_body.pop("min_tokens", None)
    prefill_body["kv_transfer_params"] = PREFILL_KV_PARAMS
    return compact_json(prefill_body)


def kv_transfer_params(answer: bytes) -> Any:
    """The `kv_transfer_params` of a prefill's JSON answer; None when it has none."""
    try:
        return json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None


async def vllm_nixl(relay: Relay, call: Call, decision: Decision) -> web.StreamResponse:
    assert decision.prefill is not None
    prefill = decision.prefill
    t0 = time.perf_counter()
    status, data = await relay.prefill(call, prefill, nixl_prefill_body(call.body))
    if status in RETRYABLE_STATUS or status >= 500:
        relay.metrics.upstream_error(prefill, f"http_{status}")
        relay.metrics.kv_handoff("failed")
        raise UpstreamUnavailable(prefill, f"prefill answered HTTP {status}")
    if status == 401:
        return relay.refused_key(prefill)
    if status != 200:
        # the request itself is wrong (too long, unknown model): say so, once
        return web.Response(body=data, status=status, content_type="application/json")
    params = kv_transfer_params(data)
    relay.metrics.kv_handoff("ok" if params else "none")
    # no params: the first token was EOS (or the prefill has no connector), so the decode
    # prefills locally; the client's own params were stripped on the way in
    raw = with_fields(call.raw, call.body, {"kv_transfer_params": params}) if params else call.raw
    return await relay.relay(call, decision.target, raw, time.perf_counter() - t0)


async def _sglang_prefill(relay: Relay, call: Call, prefill: Instance, payload: bytes) -> int:
    """The SGLang prefill's half of a request, run beside the decode's; its status."""
    status, _ = await relay.prefill(call, prefill, payload)
    if status >= 500:
        relay.metrics.upstream_error(prefill, f"http_{status}")
    relay.metrics.kv_handoff("ok" if status == 200 else "failed")
    return status


async def sglang(relay: Relay, call: Call, decision: Decision) -> web.StreamResponse:
    assert decision.prefill is not None
    prefill = decision.prefill
    body = call.body
    bootstrap = {
        "bootstrap_host": prefill.endpoint.bootstrap_host,
        "bootstrap_port": prefill.endpoint.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    pd_raw = with_fields(call.raw, body, bootstrap)
    prefill_raw = compact_json({**body, **bootstrap, "stream": False})
    prefill_task = asyncio.create_task(_sglang_prefill(relay, call, prefill, prefill_raw))
    try:
        return await relay.relay(call, decision.target, pd_raw, 0.0, watch=prefill_task)
    finally:
        if not prefill_task.done():
            prefill_task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await prefill_task


PDProtocol = Callable[[Relay, Call, Decision], Awaitable[web.StreamResponse]]
PROTOCOLS: dict[str, PDProtocol] = {"vllm-nixl": vllm_nixl, "sglang": sglang}


async def dispatch(
    relay: Relay, protocol: str, call: Call, decision: Decision
) -> web.StreamResponse:
    """Carry out one routing decision: a single engine's answer relayed, or a P/D pair's by
    `protocol` ("vllm-nixl" or "sglang")."""
    if decision.prefill is None:
        return await relay.relay(call, decision.target, call.raw, 0.0)
    return await PROTOCOLS[protocol](relay, call, decision)
