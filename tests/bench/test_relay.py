"""The round relay: a round-unique X-Request-Id on every request, the proxy's key added by the
relay (never on the generator's command line), bytes passed through, generation counted."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hgxserve.bench.relay import RoundRelay

SEEN: list[dict[str, str]] = []


class Upstream(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        SEEN.append({k.lower(): v for k, v in self.headers.items()} | {"path": self.path})
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        out = b"data: " + body + b"\n\ndata: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[str]:
    """The URL of an `Upstream` on 127.0.0.1, what it saw (SEEN) emptied first."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    SEEN.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_request_gets_the_round_prefix_and_the_key(upstream: str) -> None:
    with RoundRelay(upstream, "run1-a-c1-s0", api_key="k3y-secret") as relay:
        for i in range(3):
            req = urllib.request.Request(
                relay.url + "/v1/completions",
                data=json.dumps({"prompt": f"p{i}"}).encode(),
                headers={"X-Request-Id": "client-uuid", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.headers["X-Request-Id"] == f"run1-a-c1-s0-{i + 1:07d}"
                assert resp.read() == b'data: {"prompt": "p%d"}\n\ndata: [DONE]\n\n' % i
        urllib.request.urlopen(relay.url + "/v1/models", timeout=10).read()
        assert relay.counts.sent == 3  # GETs reach no engine
        relay.new_round("run1-b-c1-s0")
        urllib.request.urlopen(
            urllib.request.Request(relay.url + "/v1/completions", data=b"{}"), timeout=10
        ).read()
        assert relay.counts.sent == 1
    ids = [h["x-request-id"] for h in SEEN]
    assert ids == [
        "run1-a-c1-s0-0000001", "run1-a-c1-s0-0000002", "run1-a-c1-s0-0000003",
        "run1-a-c1-s0-0000004", "run1-b-c1-s0-0000001",
    ]  # fmt: skip
    assert {h["authorization"] for h in SEEN} == {"Bearer k3y-secret"}
    assert SEEN[0]["path"] == "/v1/completions"


def test_only_the_generators_requests_are_forwarded_with_the_key(upstream: str) -> None:
    """Any local process could reach the relay: it must not lend the proxy's key to other
    methods or paths (`/invocations`, `/metrics`, `DELETE …`)."""
    with RoundRelay(upstream, "r", api_key="k3y-secret") as relay:
        for method, path in [
            ("POST", "/invocations"), ("GET", "/metrics"), ("POST", "/v1/models"),
            ("GET", "/v1/completions"), ("DELETE", "/v1/chat/completions"),
            ("POST", "/v1/completions/../../tokenize"),
        ]:  # fmt: skip
            req = urllib.request.Request(relay.url + path, data=b"{}", method=method)
            try:
                urllib.request.urlopen(req, timeout=10)
                raise AssertionError(f"{method} {path} was forwarded")
            except urllib.error.HTTPError as exc:
                assert exc.code == 403, (method, path)
        assert relay.counts.sent == 0
    assert SEEN == []
