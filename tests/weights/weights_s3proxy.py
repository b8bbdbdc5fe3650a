"""A counting, fault-injecting HTTP proxy in front of the local S3 server (test-only).

It forwards every request unchanged (Host header included, so signatures stay valid) and records
method, Host, path and Range, so tests can assert which requests a sync made. Faults: answer the
next N object GETs with 503 SlowDown, delay object GETs, or refuse path-style requests the way a
store that forbids them does. It also works as an HTTP forward proxy (absolute-URI requests), which
lets a test use virtual-hosted names like models.s3.test that no resolver knows.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Seen:
    method: str
    host: str
    path: str
    range: str | None


@dataclass
class Faults:
    slowdown_gets: int = 0  # answer this many ranged GETs with 503 SlowDown
    get_delay: float = 0.0  # seconds before answering each ranged GET
    forbid_path_style_bucket: str | None = None
    # answer this many ranged GETs with the full Content-Length but only the first half of the
    # body, bytes inverted, then drop the connection: a client that keeps any of it is caught
    cut_gets: int = 0


@dataclass
class ProxyState:
    upstream: tuple[str, int]
    seen: list[Seen] = field(default_factory=list)
    faults: Faults = field(default_factory=Faults)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slowdowns_sent: int = 0
    cuts_sent: int = 0

    def object_gets(self) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.method == "GET" and s.range]

    def reset(self) -> None:
        with self.lock:
            self.seen.clear()
            self.faults = Faults()
            self.slowdowns_sent = 0
            self.cuts_sent = 0


def make_handler(state: ProxyState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            target = self.path
            if target.startswith("http://"):
                parsed = urllib.parse.urlsplit(target)
                target = parsed.path + (f"?{parsed.query}" if parsed.query else "")
            host = self.headers.get("Host", "")
            seen = Seen(self.command, host, target, self.headers.get("Range"))
            with state.lock:
                state.seen.append(seen)
                faults = state.faults
                slowdown = False
                if seen.range and self.command == "GET" and faults.slowdown_gets > 0:
                    faults.slowdown_gets -= 1
                    state.slowdowns_sent += 1
                    slowdown = True
                cut = False
                if seen.range and self.command == "GET" and not slowdown and faults.cut_gets > 0:
                    faults.cut_gets -= 1
                    state.cuts_sent += 1
                    cut = True
            bucket = faults.forbid_path_style_bucket
            if bucket and target.startswith(f"/{bucket}/"):
                self._reply(
                    400,
                    b"<Error><Code>PathStyleDomainForbidden</Code><Message>Please "
                    b"use virtual hosted style to access.</Message></Error>",
                )
                return
            if slowdown:
                self._reply(
                    503,
                    b"<Error><Code>SlowDown</Code><Message>Please reduce your "
                    b"request rate.</Message></Error>",
                )
                return
            if seen.range and faults.get_delay:
                time.sleep(faults.get_delay)
            conn = http.client.HTTPConnection(*state.upstream, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "proxy-connection"}
            conn.request(self.command, target, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for key, value in resp.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if cut and resp.status in (200, 206) and len(data) > 1:
                self.wfile.write(bytes(b ^ 0xFF for b in data[: len(data) // 2]))
                self.wfile.flush()
                self.close_connection = True
                conn.close()
                return
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

    return Handler


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client killed mid-response (the resume test) is expected here


def start_proxy(upstream: tuple[str, int]) -> tuple[ThreadingHTTPServer, ProxyState]:
    state = ProxyState(upstream)
    server = _QuietServer(("127.0.0.1", 0), make_handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state
