"""A lean HTTP/1.1 client for the proxy's hot path: pooled keep-alive connections to engines.

    client = Upstream(connect_timeout=5)
    resp = await client.post("http://10.0.0.11:8100", "/v1/completions", body, "req-1",
                             read_timeout=600)
    try:
        data = await resp.read()            # or: async for chunk in resp.chunks(): ...
    finally:
        resp.release()                      # back to the pool if the answer was read whole

Why not aiohttp's client here: per request it builds request/response objects, header
multidicts, a writer task and read timers, which was most of the proxy's CPU per request. This
client writes one buffer per request and parses the engine's answer (Content-Length, chunked or
until close) directly in `data_received`. Health checks and `/v1/models` still use aiohttp.

Errors are `UpstreamError` (with `kind`, for metrics; `connect_failed` when no connection
could be made) or `TimeoutError`. A request whose connection was reused and closed by the engine
before any answer byte is sent again once on a new connection (the engine closed an idle
keep-alive connection; it never saw the request).

The pool is bounded: at most `max_idle` idle connections per engine (1024: fewer makes a
proxy under high concurrency close and reopen a connection per request), each closed after
`idle_timeout` seconds unused (below uvicorn's 5 s keep-alive, which vLLM's API server uses, so
the proxy rarely picks a connection the engine is closing). Connections in use are bounded by
the proxy's in-flight cap: a request holds at most one connection per engine it talks to.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

from hgxserve.base.compat import timeout

MAX_HEAD_BYTES = 64 * 1024
# Stop reading from the engine while this much answer waits for a slow client. With its
# transport buffer it is what a stalled stream holds in the proxy (the soak benchmark,
# --scenario stalled): 1.36 MiB of RSS per stream at 1 MiB (~2.7 GiB at max_in_flight), about
# 0.8 MiB at 256 KiB. A streamed answer is a few KB a second, so only a client far behind
# fills it; 256 KiB streamed as fast as 1 MiB (docs/proxy.md "CPU per request").
PAUSE_BYTES = 256 * 1024


CONNECT_FAILURES = ("ClientConnectorError", "ConnectionTimeoutError")


class UpstreamError(Exception):
    """The engine could not be reached or its answer broke off; `kind` names the failure."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def connect_failed(self) -> bool:
        """No connection could be made: the engine is down, not just this request."""
        return self.kind in CONNECT_FAILURES


class Response:
    """One engine answer: status and headers at once, the body as it arrives."""

    __slots__ = (
        "conn", "status", "headers", "keep_alive", "done", "error", "got_bytes", "_head",
        "_mode", "_left", "_cbuf", "_chunk_state", "_queue", "_queued", "_paused", "_waiter",
        "head_ready", "_read_timeout", "_deadline", "_last", "_timed",
    )  # fmt: skip

    def __init__(self, conn: _Conn, read_timeout: float | None, deadline: float | None) -> None:
        self.conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.done = False
        self.error: BaseException | None = None
        self.got_bytes = False
        self._head = b""
        self._mode = ""  # length | chunked | close
        self._left = 0  # body bytes left (length mode) or in the current chunk (chunked)
        self._cbuf: bytearray | None = None  # unparsed chunked framing (chunked mode)
        self._chunk_state = "size"  # size | data | crlf | trailer
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.head_ready: asyncio.Future[None] = conn.loop.create_future()
        # the connection's timer watches the answer's time limits (`_Conn.watch`)
        self._read_timeout = read_timeout
        self._deadline = deadline
        self._last = conn.loop.time()
        self._timed = read_timeout is not None or deadline is not None
        if self._timed:
            conn.watch(self._due())

    # ---------------------------------------------------------------- fed by the protocol

    def feed(self, data: bytes) -> None:
        self.got_bytes = True
        if self._timed:
            self._last = self.conn.loop.time()
        if not self.head_ready.done():
            data = self._feed_head(data)
            if not data:
                return
        if self._mode == "length":
            self._feed_length(data)
        elif self._mode == "chunked":
            self._feed_chunked(data)
        else:
            self._push(data)

    def _feed_head(self, data: bytes) -> bytes:
        """Collect the answer's head; once it is complete, the body bytes that came with it
        (b"" while it is not, or when the answer is already over)."""
        if self._head:
            data = self._head + data  # (a head usually comes whole in its first packet)
        end = data.find(b"\r\n\r\n")
        if end < 0:
            self._head = data
            if len(data) > MAX_HEAD_BYTES:
                self.fail(UpstreamError("ClientResponseError", "answer headers too large"))
            return b""
        try:
            self._parse_head(data[:end])
        except (ValueError, UnicodeDecodeError) as exc:
            self.fail(UpstreamError("ClientResponseError", f"bad answer head: {exc}"))
            return b""
        data = data[end + 4 :]
        self._head = b""
        self.head_ready.set_result(None)
        if self._mode == "length" and self._left == 0:
            self._finish()
        if data and self.done:
            self.keep_alive = False  # bytes after a complete answer: do not reuse
            return b""
        return data

    def _feed_length(self, data: bytes) -> None:
        if len(data) > self._left:
            self.keep_alive = False
            data = data[: self._left]
        self._left -= len(data)
        self._push(data)
        if self._left == 0:
            self._finish()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not HTTP/1.x: {lines[0][:40]!r}")
        self.status = int(rest[:3])
        headers = self.headers
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                headers[key.strip().lower()] = value.strip()
        conn_hdr = headers.get("connection", "").lower()
        self.keep_alive = (
            "close" not in conn_hdr if version == "HTTP/1.1" else "keep-alive" in conn_hdr
        )
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
            self._cbuf = bytearray()
        elif "content-length" in headers:
            self._mode = "length"
            self._left = int(headers["content-length"])
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._mode = "length"
            self._left = 0
        else:
            self._mode = "close"
            self.keep_alive = False

    def _feed_chunked(self, data: bytes) -> None:
        buf = self._cbuf
        assert buf is not None
        buf += data
        pos = 0
        n = len(buf)
        while pos < n and not self.done:
            state = self._chunk_state
            if state == "data":
                take = min(self._left, n - pos)
                self._push(bytes(buf[pos : pos + take]))
                pos += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = "crlf"
            elif state == "crlf":
                if n - pos < 2:
                    break
                pos += 2
                self._chunk_state = "size"
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 4096:
                        self.fail(UpstreamError("ClientPayloadError", "bad chunk framing"))
                    break
                self._chunk_line(bytes(buf[pos:eol]))
                pos = eol + 2
        del buf[:pos]
        if self.done and buf:
            self.keep_alive = False

    def _chunk_line(self, line: bytes) -> None:
        """A chunk-size line, or a trailer line (the empty one ends the answer)."""
        if self._chunk_state == "trailer":
            if not line:
                self._finish()
            return
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            self.fail(UpstreamError("ClientPayloadError", f"bad chunk size {line[:20]!r}"))
            return
        if size == 0:
            self._chunk_state = "trailer"
        else:
            self._left = size
            self._chunk_state = "data"

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._queue.append(data)
        self._queued += len(data)
        if self._queued > PAUSE_BYTES and not self._paused and self.conn.transport is not None:
            self._paused = True
            self.conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.done = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """The answer cannot complete: wake readers with `exc`, never reuse the connection."""
        if self.done:
            return
        self.done = True
        self.error = exc
        self.keep_alive = False
        if not self.head_ready.done():
            self.head_ready.set_exception(exc)
            self.head_ready.exception()  # retrieved: a caller may already have given up
        self._wake()
        self.conn.close()

    def lost(self, exc: BaseException | None) -> None:
        if self.done:
            return
        if self._mode == "close" and self.head_ready.done():
            self._finish()  # the answer ends with the connection
            return
        why = f"connection closed{': ' + repr(exc) if exc else ''}"
        kind = "ServerDisconnectedError" if self.got_bytes or exc is None else "ClientOSError"
        self.fail(UpstreamError(kind, why))

    def _due(self) -> float:
        due = self._deadline if self._deadline is not None else float("inf")
        if self._read_timeout is not None:
            due = min(due, self._last + self._read_timeout)
        return due

    def check_time(self) -> None:
        """Fail the answer if a time limit passed; else have the connection look again when
        the next one is due (its timer fired, for this answer or an earlier one)."""
        due = self._due()
        if self.conn.loop.time() >= due:
            if self._deadline is not None and due >= self._deadline:
                self.fail(TimeoutError("no complete answer in time"))
            else:
                self.fail(TimeoutError(f"no answer byte for {self._read_timeout} s"))
        else:
            self.conn.watch(due)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---------------------------------------------------------------- consumer side

    async def _wait(self) -> None:
        self._waiter = self.conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        if len(self._queue) == 1:
            data = self._queue.popleft()
        else:
            data = b"".join(self._queue)
            self._queue.clear()
        self._queued = 0
        if self._paused and self.conn.transport is not None:
            self._paused = False
            self.conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        while not self.done:
            await self._wait()
        if self.error is not None:
            raise self.error
        return self._take() if self._queue else b""

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked framing removed), until the answer ends."""
        while True:
            if self._queue:
                yield self._take()
                continue
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self._wait()

    def release(self) -> None:
        """Return the connection to the pool if the answer was read whole, else close it."""
        conn = self.conn
        conn.response = None
        if self.done and self.error is None and self.keep_alive and not self._queue:
            conn.pool_put()
        else:
            conn.close()


class _Conn(asyncio.Protocol):
    """One TCP connection to an engine; carries one request at a time.

    One timer per connection watches its answers' time limits, moved only when an answer is
    due earlier than it fires: arming and cancelling a timer for every answer was a measurable
    share of the proxy's CPU per request. A timer that fires early (for an answer already over,
    or before the current one is due) looks at the current answer and waits again.
    """

    __slots__ = (
        "origin", "loop", "transport", "response", "closed", "used", "idle_since", "timer",
        "timer_due",
    )  # fmt: skip

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.loop = origin.loop
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.used = False
        self.idle_since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_due = 0.0

    def watch(self, due: float) -> None:
        """Have the timer fire at `due` (loop time), unless it already fires by then."""
        if self.timer is not None:
            if self.timer_due <= due:
                return
            self.timer.cancel()
        self.timer_due = due
        self.timer = self.loop.call_at(due, self._time_up)

    def _time_up(self) -> None:
        self.timer = None
        resp = self.response
        if resp is not None and not resp.done:
            resp.check_time()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods; both
        # loops set TCP_NODELAY on every TCP transport themselves
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:
            self.close()  # nothing was asked: a broken or chatty server
            return
        resp.feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._stop_timer()
        self.origin.drop(self)
        if self.response is not None:
            self.response.lost(exc)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_timer()
            self.origin.drop(self)
            if self.transport is not None:
                self.transport.abort()  # the engine sees the connection end and aborts

    def pool_put(self) -> None:
        if self.closed:
            return
        origin = self.origin
        if len(origin.idle) >= origin.max_idle:
            self.close()
            return
        self.idle_since = self.loop.time()
        origin.idle.append(self)


class _Origin:
    """Idle connections to one scheme://host:port."""

    def __init__(self, base_url: str, loop: asyncio.AbstractEventLoop, max_idle: int) -> None:
        parts = urlsplit(base_url)
        self.loop = loop
        self.max_idle = max_idle
        self.host = parts.hostname or ""
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.netloc = parts.netloc
        self.idle: list[_Conn] = []
        self.ssl_context = ssl.create_default_context() if self.tls else None

    def drop(self, conn: _Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close_idle(self, older_than: float) -> None:
        """Close idle connections unused since before `older_than` (loop time)."""
        # the list is in put order: the stale ones are at its start
        while self.idle and self.idle[0].idle_since < older_than:
            self.idle.pop(0).close()


class Upstream:
    """Pooled keep-alive HTTP/1.1 POSTs to engines (no per-request client objects).

    `api_key`: sent to every engine as `Authorization: Bearer <key>` (vLLM's VLLM_API_KEY).
    """

    def __init__(
        self,
        connect_timeout: float,
        *,
        api_key: str | None = None,
        max_idle: int = 1024,
        idle_timeout: float = 4.0,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.origins: dict[str, _Origin] = {}
        self.heads: dict[tuple[str, str], bytes] = {}
        self.auth_line = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._sweeper: asyncio.TimerHandle | None = None

    def _origin(self, base_url: str) -> _Origin:
        origin = self.origins.get(base_url)
        if origin is None:
            loop = asyncio.get_running_loop()
            origin = self.origins[base_url] = _Origin(base_url, loop, self.max_idle)
            if self._sweeper is None:
                self._sweeper = loop.call_later(self.idle_timeout, self._sweep)
        return origin

    def _sweep(self) -> None:
        """Close connections idle longer than `idle_timeout`; runs every `idle_timeout`."""
        loop = asyncio.get_running_loop()
        older_than = loop.time() - self.idle_timeout
        for origin in self.origins.values():
            origin.close_idle(older_than)
        self._sweeper = loop.call_later(self.idle_timeout, self._sweep)

    def idle_count(self) -> int:
        return sum(len(o.idle) for o in self.origins.values())

    async def _connect(self, origin: _Origin, deadline: float | None) -> _Conn:
        limit = self.connect_timeout
        if deadline is not None:
            limit = max(0.0, min(limit, deadline - origin.loop.time()))
        try:
            async with timeout(limit):
                _, proto = await origin.loop.create_connection(
                    lambda: _Conn(origin),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl_context,
                    server_hostname=origin.host if origin.tls else None,
                )
        except TimeoutError as exc:
            raise UpstreamError("ConnectionTimeoutError", f"connect to {origin.netloc}") from exc
        except OSError as exc:
            raise UpstreamError(
                "ClientConnectorError", f"connect to {origin.netloc}: {exc}"
            ) from exc
        return proto

    async def post(  # noqa: PLR0913 - one engine call: path, body, headers and its two deadlines
        self,
        base_url: str,
        path: str,
        body: bytes,
        request_id: str,
        read_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> Response:
        """Send a JSON POST; return once the answer's status and headers are in.

        `read_timeout`: longest silence from the engine; `total_timeout`: the whole call,
        connecting included, until the last body byte.

        Example: resp = await up.post("http://127.0.0.1:8100", "/v1/completions", b"{}", "r1")
        """
        origin = self._origin(base_url)
        deadline = None if total_timeout is None else origin.loop.time() + total_timeout
        head = self.heads.get((base_url, path))
        if head is None:
            head = self.heads[(base_url, path)] = (
                f"POST {path} HTTP/1.1\r\nHost: {origin.netloc}\r\n"
                f"Content-Type: application/json\r\nAccept: */*\r\n{self.auth_line}"
            ).encode()
        message = b"".join(
            (
                head,
                b"Content-Length: %d\r\nX-Request-Id: %s\r\n\r\n"
                % (len(body), request_id.encode("utf-8", "surrogateescape")),
                body,
            )
        )
        fresh = False
        while True:
            conn = None
            stale = origin.loop.time() - self.idle_timeout
            while origin.idle and not fresh:
                cand = origin.idle.pop()
                if not cand.closed and cand.idle_since >= stale:
                    conn = cand
                    break
                cand.close()
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, deadline)
            resp = Response(conn, read_timeout, deadline)
            conn.response = resp
            conn.used = True
            assert conn.transport is not None
            conn.transport.write(message)
            try:
                await resp.head_ready
            except UpstreamError:
                if reused and not resp.got_bytes:
                    fresh = True  # the engine had closed this idle connection: once more, new
                    continue
                raise
            except BaseException:
                resp.release()
                raise
            return resp

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for origin in self.origins.values():
            for conn in list(origin.idle):
                conn.close()
