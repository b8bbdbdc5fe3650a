"""`hgxserve proxy serve` against simulated engines on 127.0.0.1: protocols, routing, failures."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from http.client import HTTPConnection
from typing import Any

import pytest
from harness import SimEngine, free_port, http, http_json, metric, sse_events

pytestmark = pytest.mark.timeout(90)

NIXL_P = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
NIXL_D = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
LONG = "explain the prefill phase in detail " * 40  # ~360 tokens by the byte estimate
ROUTE = "hgxserve_proxy_requests_total"


def vllm(
    engines: Callable[..., SimEngine],
    role: str | None,
    *extra: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> SimEngine:
    args = ["serve", "/models/m", "--served-model-name", "m", "--reasoning-parser", "deepseek_r1"]
    env = dict(env or {})
    if role:
        args += ["--kv-transfer-config", NIXL_P if role == "prefill" else NIXL_D]
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    return engines("vllm", [*args, *extra], env=env, port=port)


def nixl_config(
    pre: list[SimEngine], dec: list[SimEngine], comb: list[SimEngine] = (), **kw: Any
) -> dict[str, Any]:
    return {
        "protocol": "vllm-nixl",
        "served_model_name": "m",
        "pd_groups": [
            {"name": "pd-0", "prefill": [e.url for e in pre], "decode": [e.url for e in dec]}
        ],
        "combined": [e.url for e in comb],
        **kw,
    }


def chat(url: str, content: str, **body: Any) -> tuple[int, Any]:
    return http_json(
        "POST",
        url + "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": content}], **body},
        headers=body.pop("_headers", None) or {},
    )


def completion(url: str, prompt: str, **body: Any) -> tuple[int, Any]:
    return http_json("POST", url + "/v1/completions", {"model": "m", "prompt": prompt, **body})


def post_raw(port: int, body: dict[str, Any], headers: bytes = b"") -> socket.socket:
    """POST `body` to /v1/completions over a raw socket (`headers`: more header lines), for a
    test that reads the answer as it comes or walks away from it."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + headers
        + b"Content-Length: %d\r\n\r\n" % len(payload)
        + payload
    )
    return sock


def test_vllm_nixl_protocol_non_streaming_keeps_reasoning_tools_usage(engines, proxy) -> None:
    pre, dec = vllm(engines, "prefill"), vllm(engines, "decode")
    px = proxy(nixl_config([pre], [dec]))
    status, ans = http_json(
        "POST",
        px.url + "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "只输出：PD_OK"}],
            "max_tokens": 64,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            "min_tokens": 1,
            "max_completion_tokens": 64,
        },
        headers={"X-Request-Id": "req-nixl-1"},
    )
    msg = ans["choices"][0]["message"]
    assert status == 200 and msg["content"] == "PD_OK"
    assert msg["reasoning_content"].startswith("Let me think"), "reasoning survives non-streaming"
    assert ans["usage"]["completion_tokens"] > 1
    p_req, d_req = pre.requests()[-1], dec.requests()[-1]
    assert p_req["request_id"] == d_req["request_id"]
    assert p_req["request_id"].startswith("req-nixl-1.")
    assert p_req["stream"] is False and p_req["max_tokens"] == 1
    assert p_req["max_completion_tokens"] == 1
    assert not p_req["has_stream_options"] and not p_req["has_min_tokens"]
    assert p_req["kv_transfer_params_in"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert d_req["kv_transfer_params_in"]["do_remote_prefill"] is True
    assert d_req["kv"] == "transferred" and d_req["max_tokens"] == 64 and d_req["has_min_tokens"]
    assert metric(dec.metrics(), "vllm:nixl_xfer_time_seconds_count") == 1
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    # temperature 0: the simulated answer length is then fixed (random lengths could hit 64)
    status, ans = chat(
        px.url,
        "weather in Paris?",
        tools=tools,
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    assert status == 200 and ans["choices"][0]["finish_reason"] == "tool_calls"
    assert ans["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert metric(px.metrics(), ROUTE, route="pd", code="2xx") == 2


def test_vllm_nixl_streaming_passthrough(engines, proxy) -> None:
    pre = vllm(engines, "prefill")
    dec = vllm(engines, "decode", env={"HGXSERVE_SIM_TOKEN_SECONDS": "0.05"})
    px = proxy(nixl_config([pre], [dec]))
    body = {
        "model": "m",
        "prompt": LONG,
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sock = post_raw(px.port, body)
    t0 = time.monotonic()
    first = sock.recv(65536)
    first_at = time.monotonic() - t0
    rest = b""
    while b"data: [DONE]" not in rest:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    total = time.monotonic() - t0
    sock.close()
    assert b"200 OK" in first and b"text/event-stream" in first
    assert first_at < total / 2, "chunks are relayed as they come, not buffered to the end"
    events = [
        json.loads(line[6:])
        for line in (first + rest).decode(errors="replace").split("\n")
        if line.startswith("data: {")
    ]
    assert sum(1 for e in events if e["choices"]) == 13  # 12 tokens + the finish chunk
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert pre.requests()[-1]["stream"] is False and dec.requests()[-1]["stream"] is True


def test_first_token_eos_decode_prefills_locally(engines, proxy) -> None:
    pre, dec = vllm(engines, "prefill"), vllm(engines, "decode")
    px = proxy(nixl_config([pre], [dec]))
    status, ans = completion(px.url, "FIRST_TOKEN_EOS now", max_tokens=8)
    assert status == 200 and ans["choices"][0]["finish_reason"] == "stop"
    assert pre.requests()[-1]["kv"] == "first_token_eos"
    d_req = dec.requests()[-1]
    assert d_req["kv_transfer_params_in"] is None and d_req["kv"] == "local"


def test_prompt_length_buckets(engines, proxy) -> None:
    pre, dec, comb = vllm(engines, "prefill"), vllm(engines, "decode"), vllm(engines, None)
    px = proxy(nixl_config([pre], [dec], [comb], routing={"pd_min_prompt_tokens": 200}))
    assert completion(px.url, "short one", max_tokens=4)[0] == 200
    assert completion(px.url, LONG, max_tokens=4)[0] == 200
    assert [r["prompt_tokens"] < 50 for r in comb.requests()] == [True]
    assert len(pre.requests()) == 1 and len(dec.requests()) == 1
    text = px.metrics()
    assert metric(text, ROUTE, route="combined") == 1 and metric(text, ROUTE, route="pd") == 1


def test_fallback_when_prefill_dies(engines, proxy) -> None:
    pre, dec, comb = vllm(engines, "prefill"), vllm(engines, "decode"), vllm(engines, None)
    px = proxy(
        nixl_config(
            [pre],
            [dec],
            [comb],
            routing={"pd_min_prompt_tokens": 200},
            health={"interval_s": 30, "timeout_s": 1},
        )
    )
    px.wait_in_rotation()
    pre.kill()  # still "healthy" for the next 30 s: the request itself finds it dead
    status, ans = completion(px.url, LONG, max_tokens=4)
    assert status == 200 and len(comb.requests()) == 1 and dec.requests() == []
    text = px.metrics()
    assert metric(text, ROUTE, route="fallback", code="2xx") == 1
    assert metric(text, "hgxserve_proxy_retries_total") == 1
    assert metric(text, "hgxserve_proxy_instance_healthy", role="prefill") == 0
    assert metric(text, "hgxserve_proxy_upstream_errors_total", role="prefill") == 1
    # why it is out of rotation, as `hgxserve status` reads it
    from hgxserve.status.host import parse_proxy_metrics

    out = [i for i in parse_proxy_metrics(text)["instances"] if not i["in_rotation"]]
    assert [i["role"] for i in out] == ["prefill"]
    assert out[0]["reason"].startswith("request failed: prefill unreachable")


def test_fallback_without_combined_decode_prefills_locally(engines, proxy) -> None:
    pre, dec = vllm(engines, "prefill"), vllm(engines, "decode")
    px = proxy(nixl_config([pre], [dec]))
    px.wait_in_rotation()
    pre.kill()
    status, _ = completion(px.url, LONG, max_tokens=4)
    assert status == 200
    assert dec.requests()[-1]["kv_transfer_params_in"] is None
    assert metric(px.metrics(), ROUTE, route="fallback") == 1


def test_retry_before_bytes_but_never_after_decode_streamed(engines, proxy) -> None:
    slow = {"HGXSERVE_SIM_TOKEN_SECONDS": "0.1"}
    pre = vllm(engines, "prefill")
    d1, d2 = vllm(engines, "decode", env=slow), vllm(engines, "decode", env=slow)
    px = proxy(nixl_config([pre], [d1, d2], health={"interval_s": 30, "timeout_s": 1}))
    body = {"model": "m", "prompt": "go", "max_tokens": 30, "ignore_eos": True, "stream": True}
    sock = post_raw(px.port, body, b"X-Request-Id: mid-stream\r\n")
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(65536)
    serving, other = (d1, d2) if d1.requests() else (d2, d1)
    serving.kill()  # the decode dies after bytes reached the client
    sock.settimeout(10)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
        if got.endswith(b"0\r\n\r\n"):
            break
    sock.close()
    assert b"upstream decode failed mid-stream" in got and b"[DONE]" not in got
    assert [r["request_id"] for r in other.requests()] == [], "never retried after bytes"
    assert metric(px.metrics(), "hgxserve_proxy_retries_total") == 0
    # now the dead decode is out; a new request goes to the live one without a retry
    status, _ = completion(px.url, "again", max_tokens=2)
    assert status == 200 and len(other.requests()) == 1


def test_retry_on_dead_decode_before_any_byte(engines, proxy) -> None:
    pre, d1, d2 = vllm(engines, "prefill"), vllm(engines, "decode"), vllm(engines, "decode")
    px = proxy(nixl_config([pre], [d1, d2], health={"interval_s": 30, "timeout_s": 1}))
    px.wait_in_rotation()
    d1.kill()
    d2.kill()
    d3_port = d2.port
    d2 = vllm(engines, "decode", port=d3_port)  # d2 back on its port; d1 stays dead
    for _ in range(4):
        assert completion(px.url, "hi", max_tokens=2)[0] == 200
    assert len(d2.requests()) == 4
    assert metric(px.metrics(), "hgxserve_proxy_retries_total") <= 1


def test_auth_refused_without_key(engines, proxy, tmp_path) -> None:
    comb = vllm(engines, None)
    key_file = tmp_path / "api-key"
    key_file.touch(mode=0o600)  # a key file is private (hgxserve.base.apikeys)
    key_file.write_text("s3cr3t-key-0123456789abcdef0123456789\n")
    px = proxy(
        {
            "protocol": "vllm-nixl",
            "served_model_name": "m",
            "combined": [comb.url],
            "auth": {"api_key_file": str(key_file)},
            "limits": {"max_body_bytes": 4096},
        }
    )
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert http_json("POST", px.url + "/v1/completions", body)[0] == 401
    bad = {"Authorization": "Bearer wrong"}
    assert http_json("POST", px.url + "/v1/completions", body, headers=bad)[0] == 401
    assert http_json("GET", px.url + "/v1/models")[0] == 401
    good = {"Authorization": "Bearer s3cr3t-key-0123456789abcdef0123456789"}
    assert http_json("POST", px.url + "/v1/completions", body, headers=good)[0] == 200
    status, models = http_json("GET", px.url + "/v1/models", headers=good)
    assert status == 200 and models["data"][0]["id"] == "m"
    big = {**body, "prompt": "x" * 8000}
    assert http_json("POST", px.url + "/v1/completions", big, headers=good)[0] == 413
    assert comb.requests()[-1]["prompt_tokens"] < 10, "oversized body never reached the engine"
    assert http("GET", px.url + "/health")[0] == 200, "/health needs no key (probes)"
    assert "s3cr3t" not in px.log()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_upstream(engines, proxy, stream: bool) -> None:
    pre = vllm(engines, "prefill")
    dec = vllm(engines, "decode", env={"HGXSERVE_SIM_TOKEN_SECONDS": "0.1"})
    px = proxy(nixl_config([pre], [dec]))
    body = {"model": "m", "prompt": "go", "max_tokens": 100, "ignore_eos": True, "stream": stream}
    sock = post_raw(px.port, body)
    if stream:
        sock.recv(65536)
    else:
        time.sleep(0.5)
    sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (dec.requests() and dec.requests()[-1]["aborted"]):
        time.sleep(0.05)
    assert dec.requests()[-1]["aborted"] is True, "decode saw the request cancelled"
    assert metric(dec.metrics(), "vllm:num_requests_running") == 0
    assert metric(dec.metrics(), "vllm:request_success_total", finished_reason="abort") == 1
    time.sleep(0.2)
    assert metric(px.metrics(), "hgxserve_proxy_outstanding_requests", role="decode") == 0


def test_instance_ejected_and_readmitted(engines, proxy) -> None:
    c1, c2 = vllm(engines, None), vllm(engines, None)
    px = proxy(
        {
            "protocol": "vllm-nixl",
            "served_model_name": "m",
            "combined": [c1.url, c2.url],
            "health": {
                "interval_s": 0.1,
                "timeout_s": 0.5,
                "unhealthy_after": 2,
                "healthy_after": 2,
            },
        }
    )
    healthy = "hgxserve_proxy_instance_healthy"

    def wait_for(url: str, value: float) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if metric(px.metrics(), healthy, instance=url) == value:
                return
            time.sleep(0.05)
        raise AssertionError(f"{url} never became healthy={value}")

    wait_for(c2.url, 1)
    c1_port = c1.port
    c1.stop()
    wait_for(c1.url, 0)
    from hgxserve.status.host import parse_proxy_metrics

    out = {i["url"]: i for i in parse_proxy_metrics(px.metrics())["instances"]}[c1.url]
    assert out["in_rotation"] is False
    assert re.match(r"\d+ failed health check\(s\) of /health: ", out["reason"]), out["reason"]
    assert "refused" in out["reason"].lower(), out["reason"]
    for _ in range(3):
        assert completion(px.url, "hi", max_tokens=2)[0] == 200
    assert metric(px.metrics(), "hgxserve_proxy_retries_total") == 0, "ejected: never tried"
    back = vllm(engines, None, port=c1_port)
    wait_for(back.url, 1)
    for _ in range(4):
        completion(px.url, "hi", max_tokens=2)
    assert len(back.requests()) >= 1, "readmitted instance takes traffic again"


def test_sglang_pd_protocol(sglang, proxy) -> None:
    pre, dec, config = sglang.pd("--reasoning-parser", "qwen3")
    px = proxy(config)
    status, ans = chat(px.url, "Only answer: PD_OK", max_tokens=64, temperature=0)
    msg = ans["choices"][0]["message"]
    assert status == 200 and msg["content"] == "PD_OK" and msg["reasoning_content"]
    status, raw, _ = http(
        "POST",
        px.url + "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "stream": True,
        },
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    p_rooms = [r["bootstrap_room"] for r in pre.requests()]
    d_rooms = [r["bootstrap_room"] for r in dec.requests()]
    assert p_rooms == d_rooms and len(set(d_rooms)) == 2 and None not in d_rooms
    assert metric(dec.metrics(), "sglang:kv_transfer_latency_ms_count") == 2
    gen = metric(pre.metrics(), "sglang:generation_tokens_total")
    time.sleep(0.5)  # health checks ran several times meanwhile: none of them generated
    assert metric(pre.metrics(), "sglang:generation_tokens_total") == gen


def test_unknown_path_404_wrong_method_405_with_openai_errors(engines, proxy) -> None:
    px = proxy(nixl_config([vllm(engines, "prefill")], [vllm(engines, "decode")]))
    status, body = http("GET", px.url + "/v1/nothing")[:2]
    assert status == 404 and json.loads(body)["error"]["code"] == 404
    status, body = http("GET", px.url + "/v1/completions")[:2]
    assert status == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = http("POST", px.url + "/v1/completions", "a JSON string, not an object")[:2]
    assert status == 400 and "JSON object" in json.loads(body)["error"]["message"]


def test_whole_answers_on_one_kept_alive_connection_are_complete(engines, proxy) -> None:
    """A non-streamed answer to a keep-alive HTTP/1.1 client is written in one piece by the
    proxy itself (not aiohttp's Response): status line, headers and body as aiohttp would send
    them, an engine's error status kept, and the connection serving the next request; an HTTP/1.0
    client still gets aiohttp's answer."""
    px = proxy(nixl_config([vllm(engines, "prefill")], [vllm(engines, "decode")]))
    conn = HTTPConnection("127.0.0.1", px.port, timeout=10)
    asks = [
        ({"prompt": LONG, "max_tokens": 3}, {"X-Request-Id": "trace-7"}, 200, "OK"),
        ({"prompt": "hi", "max_tokens": 100000}, {}, 400, "Bad Request"),  # past max_model_len
        ({"prompt": "hi", "max_tokens": 2}, {}, 200, "OK"),
    ]
    socks = set()
    for body, headers, status, reason in asks:
        conn.request("POST", "/v1/completions", json.dumps({"model": "m", **body}),
                     {"Content-Type": "application/json", **headers})  # fmt: skip
        resp = conn.getresponse()
        data = resp.read()
        socks.add(id(conn.sock))
        assert (resp.status, resp.reason, resp.version) == (status, reason, 11), data[:200]
        assert resp.getheader("Content-Type", "").startswith("application/json")
        assert int(resp.getheader("Content-Length", "-1")) == len(data)
        assert resp.getheader("Date", "").endswith(" GMT")
        assert re.fullmatch(
            r"[0-9a-f]{32}|trace-7\.[0-9a-f]{16}", resp.getheader("X-Request-Id", "")
        )
        assert resp.getheader("X-Client-Request-Id") == headers.get("X-Request-Id")
        if status == 200:
            assert json.loads(data)["choices"][0]["text"]
        else:
            assert json.loads(data)["error"]
    assert len(socks) == 1 and conn.sock is not None  # one connection served all three
    conn.close()
    with socket.create_connection(("127.0.0.1", px.port), timeout=10) as sock:
        payload = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))  # fmt: skip
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    head, _, data = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK") and json.loads(data)["choices"][0]["text"]
    assert metric(px.metrics(), ROUTE, route="pd", code="2xx") == 3
