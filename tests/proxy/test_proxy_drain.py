"""Drain, pause and reload of a real `hgxserve proxy serve` (docs/proxy.md "Drain and reload").

Simulated engines on 127.0.0.1 generate slowly (HGXSERVE_SIM_TOKEN_SECONDS), so a stream is
in flight when the proxy gets its signal; each test checks what that stream received, what a
request arriving meanwhile gets, and when the process exits.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from harness import SimEngine, free_port, http, metric, sse_events

pytestmark = pytest.mark.timeout(90)

TOKEN_S = "0.05"  # each simulated token takes 50 ms: 40 tokens stream for 2 s


def slow_engine(engines: Callable[..., SimEngine]) -> SimEngine:
    args = ["serve", "/models/m", "--served-model-name", "m"]
    return engines("vllm", args, env={"HGXSERVE_SIM_TOKEN_SECONDS": TOKEN_S})


def config(*eng: SimEngine, **limits: Any) -> dict[str, Any]:
    return {
        "protocol": "vllm-nixl",
        "served_model_name": "m",
        "combined": [e.url for e in eng],
        "limits": {"drain_timeout_s": 30, **limits},
    }


def slow_proxy(
    engines: Callable[..., SimEngine], proxy: Callable[..., Any], **limits: Any
) -> tuple[Any, SimEngine]:
    """A proxy (with `limits`) in front of one slow engine, once the engine is in rotation."""
    eng = slow_engine(engines)
    p = proxy(config(eng, **limits))
    p.wait_in_rotation()
    return p, eng


class Stream(threading.Thread):
    """One streamed completion of `tokens` tokens, read to its end in the background."""

    def __init__(self, url: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.status = 0
        self.events: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "m", "prompt": "tell a long story", "max_tokens": self.tokens,
                "stream": True, "ignore_eos": True}  # fmt: skip
        try:
            self.status, raw, _ = http("POST", self.url + "/v1/completions", body, timeout=60)
            self.events = sse_events(raw)
        except Exception as exc:  # a reset connection is what this must never see
            self.error = exc

    def text_chunks(self) -> int:
        return sum(
            1
            for e in self.events
            if isinstance(e, dict) and e["choices"] and e["choices"][0]["text"]
        )

    def finish(self) -> str | None:
        reasons = [e["choices"][0].get("finish_reason") for e in self.events
                   if isinstance(e, dict) and e["choices"]]  # fmt: skip
        return next((r for r in reasons if r), None)


def in_flight(url: str) -> float:
    return metric(http("GET", url + "/metrics")[1].decode(), "hgxserve_proxy_in_flight_requests")


def wait_until(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def started_stream(url: str, tokens: int) -> Stream:
    stream = Stream(url, tokens)
    stream.start()
    wait_until(lambda: in_flight(url) >= 1)
    return stream


def assert_turned_away(url: str) -> None:
    status, raw, headers = http("POST", url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 503, raw
    assert headers["Retry-After"] == "5"
    assert json.loads(raw)["error"]["type"] == "service_unavailable"


def test_sigterm_lets_the_stream_finish_turns_new_requests_away_and_exits(engines, proxy) -> None:
    p, eng = slow_proxy(engines, proxy)
    stream = started_stream(p.url, 60)  # 3 s of tokens
    p.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http("GET", p.url + "/health")[0] == 503)
    assert json.loads(http("GET", p.url + "/health")[1]) == {"status": "draining"}
    assert_turned_away(p.url)
    text = p.metrics()
    assert metric(text, "hgxserve_proxy_draining") == 1
    assert metric(text, "hgxserve_proxy_refused_total", reason="draining") == 1
    assert p.proc.poll() is None  # still serving the stream
    stream.join(30)
    assert stream.error is None and stream.status == 200
    assert stream.text_chunks() == 60 and stream.finish() == "length"
    assert p.proc.wait(10) == 0
    assert "drained in" in p.log()
    assert not [r for r in eng.requests() if r.get("aborted")]


def test_the_drain_bound_cuts_what_is_still_in_flight(engines, proxy) -> None:
    p, _ = slow_proxy(engines, proxy, drain_timeout_s=0.5)
    stream = started_stream(p.url, 400)  # 20 s of tokens: longer than the bound
    began = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(10) == 0
    assert time.monotonic() - began < 5
    stream.join(10)
    assert stream.text_chunks() < 400
    assert "drain bound of 0.5 s passed: cutting 1 request(s) in flight" in p.log()


def reload_onto(p: Any, engine: SimEngine) -> None:
    """What a switch does: install a proxy.json naming `engine` instead, and reload (SIGHUP)."""
    p.config_path.write_text(
        json.dumps({**json.loads(p.config_path.read_text()), "combined": [engine.url]})
    )
    p.proc.send_signal(signal.SIGHUP)


def test_a_second_sigterm_exits_at_once(engines, proxy) -> None:
    p, _ = slow_proxy(engines, proxy)
    started_stream(p.url, 400)
    p.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http("GET", p.url + "/health")[0] == 503)
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(10) == 0
    assert "second stop signal: exiting with 1 request(s) in flight" in p.log()


def test_pause_keeps_listening_and_reload_admits_again_with_the_new_config(engines, proxy) -> None:
    second = slow_engine(engines)  # what the reload points the proxy at
    p, _ = slow_proxy(engines, proxy)
    stream = started_stream(p.url, 40)
    p.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: http("GET", p.url + "/health")[0] == 503)
    assert json.loads(http("GET", p.url + "/health")[1]) == {"status": "paused"}
    assert_turned_away(p.url)
    stream.join(30)
    assert stream.status == 200 and stream.text_chunks() == 40
    assert p.proc.poll() is None  # paused, not stopping
    # the switch installs the new proxy.json (another engine) and reloads
    reload_onto(p, second)
    wait_until(lambda: http("GET", p.url + "/health")[0] == 200)
    status, raw, _ = http("POST", p.url + "/v1/completions", {"model": "m", "prompt": "x",
                                                              "max_tokens": 2})  # fmt: skip
    assert status == 200, raw
    assert [r for r in second.requests() if r.get("kind") != "health"]
    assert metric(p.metrics(), "hgxserve_proxy_draining") == 0
    assert "reloaded" in p.log()


def test_reload_keeps_the_stream_in_flight_on_its_engine(engines, proxy) -> None:
    second = slow_engine(engines)  # what the reload points the proxy at
    p, first = slow_proxy(engines, proxy)
    stream = started_stream(p.url, 60)
    reload_onto(p, second)
    wait_until(lambda: "reloaded" in p.log())
    stream.join(30)
    assert stream.error is None and stream.status == 200
    assert stream.text_chunks() == 60 and stream.finish() == "length"
    # new requests go to the new engine at once: its health carried over or checked anew
    wait_until(lambda: http("GET", p.url + "/health")[0] == 200)
    assert not [r for r in first.requests() if r.get("aborted")]


def test_a_bad_or_listen_changing_reload_keeps_the_running_config(engines, proxy) -> None:
    p, _ = slow_proxy(engines, proxy)
    good = p.config_path.read_text()
    p.config_path.write_text("{not json")
    p.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused, the running configuration stays" in p.log())
    moved = {**json.loads(good), "listen": {"host": "127.0.0.1", "port": free_port()}}
    p.config_path.write_text(json.dumps(moved))
    p.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused: port change only with a restart" in p.log())
    status, raw, _ = http("POST", p.url + "/v1/completions", {"model": "m", "prompt": "x",
                                                              "max_tokens": 2})  # fmt: skip
    assert status == 200, raw


def test_a_pause_no_release_ends_admits_again_after_its_bound(engines, proxy) -> None:
    """The controller paused the proxy and died before the switch: past `pause_max_s` the
    proxy admits again by itself; a second pause starts its own bound."""
    p, _ = slow_proxy(engines, proxy, pause_max_s=1.5)
    p.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: http("GET", p.url + "/health")[0] == 503)
    assert_turned_away(p.url)
    wait_until(lambda: http("GET", p.url + "/health")[0] == 200, timeout=10)
    status, raw, _ = http("POST", p.url + "/v1/completions", {"model": "m", "prompt": "x",
                                                              "max_tokens": 2})  # fmt: skip
    assert status == 200, raw
    assert "no release reloaded or stopped the proxy: admitting requests again" in p.log()
    assert metric(p.metrics(), "hgxserve_proxy_draining") == 0
