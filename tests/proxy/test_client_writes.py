"""Writes to a client that stopped reading: every one is bounded by `client_write_timeout_s`,
whatever its size (docs/proxy.md "Front door").

An in-process aiohttp server streams through `Relay`'s own write to a raw socket that never
reads. A write larger than the kernel's socket buffers leaves more than the transport's
high-water mark unsent even when nothing was waiting before it: the transport pauses and the
write waits for a drain that never comes (it held the in-flight slot until the engine's
600 s read timeout).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
from aiohttp import web

from hgxserve.proxy.config import Limits
from hgxserve.proxy.metrics import Metrics
from hgxserve.proxy.relay import ClientStalled, Relay

BOUND_S = 0.5
# larger than any socket buffer on the path (tcp_wmem's maximum is 4 MiB by default)
LARGE = 16 << 20


def stalled_write(size: int, *, eof: bool = False) -> dict[str, Any]:
    """Serve one stream whose write of `size` bytes (or, with `eof`, whose end) meets a client
    that never reads; what the handler saw."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        metrics = Metrics()
        relay = Relay(None, metrics, Limits(client_write_timeout_s=BOUND_S))  # type: ignore[arg-type]
        done = asyncio.Event()

        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            started = time.monotonic()
            try:
                if eof:
                    # fill the transport without waiting (as answers do), then end the stream
                    await relay._write(request, out, b"x" * 1024)
                    assert request.transport is not None
                    request.transport.write(b"x" * LARGE)
                    await relay._end(request, out)
                else:
                    await relay._write(request, out, b"x" * size)
                    await relay._write(request, out, b"y" * 1024)
                seen["outcome"] = "wrote"
            except ClientStalled:
                seen["outcome"] = "stalled"
            except ConnectionError as exc:
                seen["outcome"] = repr(exc)
            finally:
                seen["seconds"] = time.monotonic() - started
                seen["stalled"] = metrics.stalled
                done.set()
            return out

        server = web.Server(handler, access_log=None)
        runner = web.ServerRunner(server)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
            client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
            # generous: the bound is 0.5 s; the old write waited for ever
            await asyncio.wait_for(done.wait(), 30)
        except TimeoutError:
            seen.setdefault("outcome", "still waiting after 30 s")
        finally:
            client.close()
            await runner.cleanup()

    asyncio.run(main())
    return seen


@pytest.mark.timeout(120)
def test_a_large_write_to_a_client_that_stopped_reading_is_cut_in_its_bound() -> None:
    """Nothing waited before the write, so the old code let it wait unbounded."""
    seen = stalled_write(LARGE)
    assert seen["outcome"] == "stalled", seen
    assert seen["stalled"] == 1
    assert seen["seconds"] < 20, seen


@pytest.mark.timeout(120)
def test_the_end_of_a_stream_to_a_client_that_stopped_reading_is_bounded_too() -> None:
    seen = stalled_write(0, eof=True)
    assert seen["outcome"] == "stalled", seen
    assert seen["stalled"] == 1
    assert seen["seconds"] < 20, seen


@pytest.mark.timeout(60)
def test_small_writes_to_a_reading_client_are_not_cut() -> None:
    """A write the socket takes at once never waits (the fast path stays)."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        metrics = Metrics()
        relay = Relay(None, metrics, Limits(client_write_timeout_s=BOUND_S))  # type: ignore[arg-type]

        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for _ in range(100):
                await relay._write(request, out, b"data: {}\n\n")
            await relay._end(request, out)
            return out

        server = web.Server(handler, access_log=None)
        runner = web.ServerRunner(server)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        seen["body"] = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        seen["stalled"] = metrics.stalled
        await runner.cleanup()

    asyncio.run(main())
    assert seen["body"].startswith(b"HTTP/1.1 200") and seen["body"].count(b"data: {}") == 100
    assert seen["stalled"] == 0
