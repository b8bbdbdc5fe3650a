"""The watcher's GET /state (root, on every address) against who may reach its port: only
loopback and the engine's hosts are served, idle or trickled requests are cut, connections are
capped, and its own reads of a peer are bounded in all; a forged generation is ignored."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hgxserve.release import watch
from hgxserve.release.watch import Members, Peers, WatchConfig, Watcher, state_server

HEAD = "hgxserve-decode-0.service"
CUT_S = 0.6  # the read timeout the tests run with (WATCH_READ_TIMEOUT_S)


def leader_config(tmp_path: Path, **fields: Any) -> WatchConfig:
    return WatchConfig(
        engine="decode-0",
        host="h-a",
        role="leader",
        unit=HEAD,
        port=13346,
        state_file=str(tmp_path / "decode-0.json"),
        health_url="http://127.0.0.1:8200/health",
        followers={"h-b": "http://10.0.0.2:13346/state", "h-c": "http://10.0.0.3:13346/state"},
        **fields,
    )


@pytest.fixture
def short_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "WATCH_READ_TIMEOUT_S", CUT_S)
    monkeypatch.setattr(watch._Handler, "timeout", CUT_S)


@pytest.fixture
def served(tmp_path: Path, short_reads: None) -> Iterator[tuple[watch.StateServer, int]]:
    watcher = Watcher(leader_config(tmp_path), Members(), lambda _: None)
    server = state_server(watcher, ("127.0.0.1", 0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, server.server_address[1]
    server.shutdown()
    server.server_close()


def get_state(port: int) -> dict[str, Any] | None:
    return Members().peer_state(f"http://127.0.0.1:{port}/state")


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading what it sends), None if it did not."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_only_loopback_and_the_engines_hosts_are_served(tmp_path: Path) -> None:
    logged: list[str] = []
    peers = Peers(leader_config(tmp_path).peer_names(), logged.append)
    assert peers.allows("127.0.0.1") and peers.allows("::1")
    assert peers.allows("10.0.0.2") and peers.allows("::ffff:10.0.0.3")
    assert not peers.allows("10.0.0.9") and not peers.allows("10.0.0.9")
    assert not peers.allows("not an address")
    assert len(logged) == 1 and "refused GET /state from 10.0.0.9" in logged[0]
    assert "10.0.0.2, 10.0.0.3" in logged[0]
    follower = WatchConfig(
        engine="decode-0",
        host="h-b",
        role="follower",
        unit=HEAD,
        port=13346,
        state_file="x",
        leader_url="http://10.0.0.1:13346/state",
    )
    assert follower.peer_names() == ["10.0.0.1"]
    named = Peers(["localhost", "no-such-host.invalid"], logged.append)
    assert named.addresses, "names are resolved"
    assert replace(follower, allow_from=["10.1.1.1"]).peer_names() == ["10.1.1.1"]


def test_a_caller_that_is_no_peer_is_closed_before_a_byte_is_read(
    served: tuple[watch.StateServer, int],
) -> None:
    server, port = served
    assert get_state(port) is not None  # loopback
    server.peers.allows = lambda address: False  # type: ignore[method-assign]
    assert get_state(port) is None


def test_an_idle_or_trickled_request_is_cut_after_the_read_timeout(
    served: tuple[watch.StateServer, int],
) -> None:
    _, port = served
    idle = socket.create_connection(("127.0.0.1", port))
    took = closed_within(idle, 5.0)
    assert took is not None and took < CUT_S + 1.0, took
    trickled = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()
    try:
        for byte in b"GET /state HTTP/1.0\r\nX-Pad: " + b"a" * 100:
            trickled.sendall(bytes([byte]))
            time.sleep(0.05)
            if time.monotonic() - start > 5.0:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    took = closed_within(trickled, 5.0)
    assert took is not None and time.monotonic() - start < CUT_S + 1.5
    assert get_state(port) is not None


def test_an_endless_request_is_read_up_to_its_bound(
    served: tuple[watch.StateServer, int],
) -> None:
    _, port = served
    sock = socket.create_connection(("127.0.0.1", port))
    sent = 0
    try:
        sock.sendall(b"GET /state HTTP/1.0\r\n")
        while sent < 64 << 20:
            sock.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
            sent += 1009
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < 16 << 20, "the server stopped reading"


def test_connections_past_the_cap_are_closed_at_once(
    served: tuple[watch.StateServer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, port = served
    monkeypatch.setattr(watch, "WATCH_READ_TIMEOUT_S", 5.0)  # the held ones stay held
    monkeypatch.setattr(watch._Handler, "timeout", 5.0)
    held = [
        socket.create_connection(("127.0.0.1", port)) for _ in range(watch.WATCH_MAX_CONNECTIONS)
    ]
    deadline = time.monotonic() + 3.0
    while server.slots._value > 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    extra = socket.create_connection(("127.0.0.1", port))
    took = closed_within(extra, 2.0)
    assert took is not None, "a connection past the cap is closed before the read timeout"
    assert server.refused_full == 1
    for sock in held:
        sock.close()
    time.sleep(0.3)
    assert get_state(port) is not None


class _Trickle(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(100):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return


def test_reading_a_peer_that_trickles_is_bounded_in_all(short_reads: None) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        assert Members().peer_state(f"http://127.0.0.1:{server.server_address[1]}/state") is None
        assert time.monotonic() - start < CUT_S + 1.0
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("generation", [True, -1, 1 << 40, "7", 2.0])
def test_a_follower_ignores_a_generation_that_is_no_count(
    tmp_path: Path, generation: object
) -> None:
    class Leader(Members):
        calls: list[tuple[str, ...]] = []

        def unit_state(self, unit: str) -> str:
            return "active"

        def systemctl(self, *args: str) -> None:
            self.calls.append(args)

        def peer_state(self, url: str) -> dict[str, Any] | None:
            return {"generation": generation, "phase": "waiting-followers"}

    config = WatchConfig(
        engine="decode-0",
        host="h-b",
        role="follower",
        unit=HEAD,
        port=13346,
        state_file=str(tmp_path / "f.json"),
        leader_url="http://10.0.0.1:13346/state",
    )
    members = Leader()
    watcher = Watcher(config, members, lambda _: None)
    watcher.step(0.0)
    assert members.calls == [] and watcher.state.generation == 0
    assert json.loads(Path(config.state_file).read_text())["generation"] == 0
