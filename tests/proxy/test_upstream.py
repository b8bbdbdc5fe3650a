"""The proxy's pooled HTTP/1.1 client against scripted raw TCP servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hgxserve.proxy.upstream import Upstream, UpstreamError

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes) -> None:
    """Read one request and send `raw` as the whole answer."""
    await read_request(reader)
    writer.write(raw)
    await writer.drain()


def run(
    script: Script,
    test: Callable[[Upstream, str, dict[str, Any]], Awaitable[None]],
    **upstream: Any,
) -> dict:
    """Serve `script` on 127.0.0.1 (one call per connection) and run `test` against it."""
    seen: dict[str, Any] = {"connections": 0, "closes": 0, "requests": [], "closed": asyncio.Event}

    async def main() -> None:
        closed = asyncio.Event()
        seen["closed"] = closed

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen["connections"] += 1
            try:
                await script(reader, writer, seen["connections"])
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                seen["closes"] += 1
                closed.set()
                writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        up = Upstream(connect_timeout=2, **upstream)
        try:
            await asyncio.wait_for(test(up, f"http://127.0.0.1:{port}", seen), 10)
        finally:
            up.close()
            server.close()

    asyncio.run(main())
    return seen


def test_content_length_answer_in_pieces_and_connection_reused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            head, body = await read_request(reader)
            assert b"X-Request-Id: r" in head and b"Content-Type: application/json" in head
            answer = b'{"echo": ' + body + b"}"
            msg = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            data = msg % len(answer) + answer
            for i in range(0, len(data), 7):  # headers and body split across many packets
                writer.write(data[i : i + 7])
                await writer.drain()
                await asyncio.sleep(0)

    async def test(up: Upstream, url: str, seen: dict) -> None:
        for i in range(3):
            resp = await up.post(url, "/v1/completions", b'{"i": %d}' % i, f"r{i}")
            assert resp.status == 200 and resp.headers["content-type"] == "application/json"
            assert await resp.read() == b'{"echo": {"i": %d}}' % i
            resp.release()

    assert run(script, test)["connections"] == 1, "keep-alive connection reused"


def test_chunked_answer_split_anywhere_with_extensions_and_trailer() -> None:
    events = [b"data: one\n\n", b"data: " + b"x" * 5000 + b"\n\n", b"data: [DONE]\n\n"]
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-T: 1\r\n\r\n"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(framed), 3):
                writer.write(framed[i : i + 3])
                await writer.drain()

    async def test(up: Upstream, url: str, seen: dict) -> None:
        for _ in range(2):
            resp = await up.post(url, "/v1/completions", b"{}", "r", read_timeout=2)
            got = [c async for c in resp.chunks()]
            assert b"".join(got) == b"".join(events)
            assert len(got) > 1, "delivered as it arrived, not buffered to the end"
            resp.release()

    assert run(script, test)["connections"] == 1


def posted_twice(answer: bytes) -> Callable[[Upstream, str, dict[str, Any]], Awaitable[None]]:
    """A test that POSTs twice in a row and reads `answer` both times."""

    async def test(up: Upstream, url: str, seen: dict) -> None:
        for _ in range(2):
            resp = await up.post(url, "/x", b"{}", "r")
            assert await resp.read() == answer
            resp.release()

    return test


def test_answer_until_close_is_not_reused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(reader, writer, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")

    assert run(script, posted_twice(b"all of it"))["connections"] == 2


def test_idle_connection_closed_by_engine_is_replaced_once() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(reader, writer, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        if n == 1:
            # keep-alive promised, but the engine drops the connection after the request
            # that follows arrives (as a keep-alive timeout racing a new request would)
            await reader.read(1)

    assert run(script, posted_twice(b"ok"))["connections"] == 2


def test_connection_refused_is_an_upstream_error() -> None:
    async def main() -> None:
        up = Upstream(connect_timeout=2)
        with pytest.raises(UpstreamError) as err:
            await up.post("http://127.0.0.1:9", "/x", b"{}", "r")
        assert err.value.kind == "ClientConnectorError" and err.value.connect_failed

    asyncio.run(main())


async def keep_alive_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while True:
        head, _ = await read_request(reader)
        body = b"auth" if b"\r\nAuthorization: Bearer engine-k3y\r\n" in head else b"none"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n" + body)
        await writer.drain()


def test_pool_keeps_at_most_max_idle_and_closes_idle_connections() -> None:
    async def test(up: Upstream, url: str, seen: dict) -> None:
        async def one() -> None:
            resp = await up.post(url, "/x", b"{}", "r")
            await resp.read()
            await asyncio.sleep(0.05)  # all 20 are open at once
            resp.release()

        await asyncio.gather(*(one() for _ in range(20)))
        assert seen["connections"] == 20 and up.idle_count() == 3, "3 kept, 17 closed"
        await asyncio.sleep(0.1)
        assert seen["closes"] == 17
        await asyncio.sleep(0.8)  # idle timeout 0.3 s: the sweeper closed the rest
        assert up.idle_count() == 0 and seen["closes"] == 20
        resp = await up.post(url, "/x", b"{}", "r")  # a new connection, not a stale one
        assert await resp.read() == b"none"
        resp.release()
        assert seen["connections"] == 21

    run(keep_alive_ok, test, max_idle=3, idle_timeout=0.3)


def test_engine_key_is_sent_as_a_bearer_token() -> None:
    async def test(up: Upstream, url: str, seen: dict) -> None:
        resp = await up.post(url, "/v1/completions", b"{}", "r")
        assert await resp.read() == b"auth"
        resp.release()

    run(keep_alive_ok, test, api_key="engine-k3y")


def test_dropped_request_is_not_a_connect_failure() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)  # then close without a byte of answer

    async def test(up: Upstream, url: str, seen: dict) -> None:
        with pytest.raises(UpstreamError) as err:
            await up.post(url, "/x", b"{}", "r")
        assert not err.value.connect_failed

    run(script, test)


def test_read_timeout_and_total_timeout() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):  # a byte every 50 ms: never silent for long, never done
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    async def test(up: Upstream, url: str, seen: dict) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await up.post(url, "/x", b"{}", "r", total_timeout=0.4)
        with pytest.raises(TimeoutError):
            await resp.read()
        assert 0.3 < loop.time() - t0 < 1.5
        resp.release()
        # silence: headers, then nothing
        resp = await up.post(url, "/x", b"{}", "r", read_timeout=0.2)
        with pytest.raises(TimeoutError):
            async for _ in resp.chunks():
                pass
        resp.release()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await script(reader, writer, n)
        else:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)

    run(silent, test)


def test_cut_off_answer_and_cancel_close_the_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
            await writer.drain()
            return  # the engine dies mid-answer
        await reader.read(1)  # waits until the proxy gives up on the request

    async def test(up: Upstream, url: str, seen: dict) -> None:
        resp = await up.post(url, "/x", b"{}", "r")
        with pytest.raises(UpstreamError) as err:
            await resp.read()
        assert err.value.kind == "ServerDisconnectedError"
        resp.release()
        seen["closed"].clear()
        task = asyncio.ensure_future(up.post(url, "/x", b"{}", "r"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(seen["closed"].wait(), 2)  # the engine saw the connection end

    assert run(script, test)["connections"] == 2
