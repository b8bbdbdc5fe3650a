"""The front door (docs/proxy.md, "Front door"): accepting clients, and admitting their requests.

    server = front_door(routes, config.limits, metrics)       # aiohttp's low-level server
    call = await Admission(config.limits, metrics, api_key).admit(request, path, endpoint, hold)

Request heads and bodies must arrive in time; open connections, requests in flight and buffered
body bytes are capped (503/429/503); a client's key is checked in constant time; its body must be
strict JSON, and its own `kv_transfer_params` and `bootstrap_*` fields never reach an engine;
warnings are bounded however many broken requests arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError

from hgxserve.base.compat import timeout
from hgxserve.proxy.body import (
    client_request_id,
    parse_body,
    request_id,
    strip_transfer_fields,
)
from hgxserve.proxy.config import Limits
from hgxserve.proxy.metrics import Metrics

log = logging.getLogger("hgxserve.proxy")
# aiohttp's server logs malformed requests here (with our bounds, not its tracebacks)
http_log = logging.getLogger("hgxserve.proxy.http")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
# path -> (method, handler, capped: counts against max_in_flight)
Routes = dict[str, tuple[str, Handler, bool]]

LINGER_S = 2.0
_REFUSED_BODY = (
    b'{"error":{"message":"Too many open connections to the proxy; retry shortly.",'
    b'"type":"service_unavailable","param":null,"code":503}}'
)
REFUSED_CONNECTION = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_REFUSED_BODY), _REFUSED_BODY)
)
# Bodies up to this size are read at once and not counted against max_buffered_body_bytes:
# the in-flight cap bounds them (2048 x 64 KiB = 128 MiB), and a prompt of 16K tokens fits.
SMALL_BODY_BYTES = 64 * 1024
# glibc mallopt(M_MMAP_THRESHOLD): a fixed threshold also turns off its adaptive one
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def error_response(status: int, message: str, etype: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": code or status}}
    return web.json_response(body, status=status)


class BoundedLog(logging.Filter):
    """Keeps the proxy's log bounded whatever clients send: one line per record (no
    tracebacks; control characters escaped; cut at 300 characters) and at most `burst`
    warnings per `window_s`, then one note of how many were dropped.
    """

    def __init__(self, burst: int = 50, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self.window_end = 0.0
        self.count = 0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = time.monotonic()
        if now >= self.window_end:
            dropped, self.dropped = self.dropped, 0
            self.window_end = now + self.window_s
            self.count = 0
        else:
            dropped = 0
        if self.count >= self.burst:
            self.dropped += 1
            return False
        self.count += 1
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {record.exc_info[1]!r}"
        text = text.encode("unicode_escape").decode("ascii")
        if len(text) > 300:
            text = text[:300] + "..."
        if dropped:
            text += f" ({dropped} warnings dropped in the last {self.window_s:g} s)"
        record.msg, record.args = text, None
        record.exc_info = record.exc_text = None
        record.stack_info = None
        return True


def bound_logs() -> None:
    """Install the `BoundedLog` filter on the proxy's loggers (once)."""
    for logger in (log, http_log):
        if not any(isinstance(f, BoundedLog) for f in logger.filters):
            logger.addFilter(BoundedLog())


def return_large_buffers_to_the_system() -> None:
    """Keep every allocation over 128 KiB (request bodies) in its own mapping, unmapped when
    freed. glibc's adaptive threshold moves such buffers into the heap after the first ones are
    freed, and a burst of large bodies then stays in the process long after it ended (the soak
    benchmark: 249 MiB kept after the attackers left, 75 MiB with this)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


# ---------------------------------------------------------------------- accepting clients


class _Refused(asyncio.Protocol):
    """A connection over the cap: one 503 answer, the client's bytes discarded, closed after
    the client closes or after a second (a plain close could reset the answer away)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(REFUSED_CONNECTION)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(1.0, self.transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()


class FrontDoor(web.Server):
    """aiohttp's low-level server with a cap on open connections.

    A connection over `max_connections` gets a canned 503 and is closed without being parsed.
    The handler's `keepalive_timeout` bounds the wait for a complete request head (aiohttp closes
    a connection whose head is unfinished when it fires, idle or not). `limits` may be replaced
    while serving (a reload): caps and body size apply from the next connection or request.
    """

    def __init__(self, handler: Handler, *, limits: Limits, metrics: Metrics, **kw: Any):
        super().__init__(handler, **kw)
        self.limits = limits
        self.metrics = metrics
        self.by_client: dict[str, int] = {}  # client address -> its open connections
        self.client_of: dict[int, str] = {}  # id(handler) -> its client address

    @property
    def max_connections(self) -> int:
        return self.limits.max_connections

    def client_cap(self) -> int:
        """Open connections one client address may hold (`max_client_share`)."""
        return max(1, int(self.limits.max_connections * self.limits.max_client_share))

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.metrics.open_connections += 1
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self.client_of[id(handler)] = client
        self.by_client[client] = self.by_client.get(client, 0) + 1
        if self.by_client[client] > self.client_cap():
            self.metrics.refuse("client_share")
            transport.write(REFUSED_CONNECTION)
            transport.close()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.metrics.open_connections -= 1
        client = self.client_of.pop(id(handler), None)
        if client is not None:
            left = self.by_client.get(client, 1) - 1
            if left > 0:
                self.by_client[client] = left
            else:
                self.by_client.pop(client, None)

    def __call__(self) -> Any:
        if self.metrics.open_connections >= self.max_connections:
            self.metrics.refuse("connections")
            return _Refused()
        return super().__call__()


async def _capped(request: web.BaseRequest, handler: Handler, door: FrontDoor) -> Any:
    """A route that counts against `max_in_flight`. A POST takes its slot once its body is in
    (FrontDoor.admit, BodyHold.take_slot): a client that announces a body and trickles it holds
    no slot meanwhile; other methods take it here. A defect in the handler is one bounded log
    line and a 500, never a traceback."""
    metrics = door.metrics
    early = request.method != "POST"
    if early:
        if metrics.in_flight >= door.limits.max_in_flight:
            metrics.refuse("in_flight")
            return TOO_MANY_IN_FLIGHT.answer()
        metrics.in_flight += 1
    try:
        return await handler(request)
    except (asyncio.CancelledError, ConnectionError, web.HTTPException):
        raise
    except Exception as exc:
        log.error("%s %s failed inside the proxy: %r", request.method, request.path, exc)
        if request.writer is not None and request.writer.output_size:
            raise ConnectionResetError("answer already started") from None
        return error_response(500, "Internal proxy error.", "internal_error")
    finally:
        if early:
            metrics.in_flight -= 1


def front_door(routes: Routes, limits: Limits, metrics: Metrics) -> FrontDoor:
    """aiohttp's low-level server: a few fixed routes need no router, app or middlewares.

    Routes marked capped count against `max_in_flight`; the others (/health, /metrics) never
    do, so probes still answer under load.
    """
    loop = asyncio.get_running_loop()
    door: FrontDoor

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        route = routes.get(request.path)
        if route is None:
            return error_response(404, "Not found.", "not_found_error")
        method, handler, capped = route
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            resp = error_response(405, f"Use {method}.", "invalid_request_error")
            resp.headers["Allow"] = method
            return resp
        if not capped:
            return await handler(request)
        return await _capped(request, handler, door)

    def make_request(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        return web.BaseRequest(
            message, payload, protocol, writer, task, loop,
            client_max_size=door.limits.max_body_bytes,
        )  # fmt: skip

    # handler_cancellation: a client that disconnects cancels its handler, which closes
    # the upstream connections, so the engines abort the request
    door = FrontDoor(
        handle,
        limits=limits,
        metrics=metrics,
        request_factory=make_request,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=limits.header_timeout_s,
        # after an early answer (413, 408), read and drop what the client still sends for
        # this long so it can read the answer; then close
        lingering_time=LINGER_S,
        logger=http_log,
    )
    return door


# ---------------------------------------------------------------------- admitting requests


@dataclass(frozen=True)
class Call:
    """One client request on its way through the proxy: what every step of routing needs."""

    request: web.BaseRequest
    path: str  # /v1/completions or /v1/chat/completions
    raw: bytes  # the body as the client sent it (relayed as is where possible)
    body: dict[str, Any]
    req_id: str  # the proxy's own (hgxserve.proxy.body.request_id)
    started: float  # perf_counter when the proxy had read the body
    client_id: str | None = None  # the client's X-Request-Id, when short and plain

    def id_headers(self) -> dict[str, str]:
        """The ids an answer carries back: the proxy's, and the client's own as it sent it."""
        out = {"X-Request-Id": self.req_id}
        if self.client_id is not None:
            out["X-Client-Request-Id"] = self.client_id
        return out

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class Written(web.StreamResponse):
    """An answer `answer_whole` already wrote to the client's connection: aiohttp's server
    has nothing left to send for it, and keeps the connection for the client's next request."""

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None

    @property
    def keep_alive(self) -> bool:
        return True


_STATUS_LINES: dict[int, bytes] = {}
_date: list[Any] = [0, b""]  # [second, its Date header line], formatted once a second


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


def _date_line() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
    return cast(bytes, _date[1])


def answer_whole(call: Call, status: int, ctype: str, body: bytes) -> web.StreamResponse:
    """The client's answer with a body known whole: written to its connection in one piece.

    aiohttp's Response (a header multidict, a payload writer, its preparation) costs 0.01-0.02
    ms of CPU per request more than this one write (measured on aiohttp 3.14, docs/proxy.md
    "CPU per request"); the usual answer (HTTP/1.1, keep-alive, nothing waiting to go out)
    needs none of it. Any other case, or a content type that could split a header, takes
    aiohttp's way.
    """
    request = call.request
    transport = request.transport
    if (
        transport is None
        or status < 200
        or status in (204, 304)  # (answers without a body: aiohttp drops what an engine sent)
        or transport.get_write_buffer_size()
        or request.version != HttpVersion11
        or not request.keep_alive
        or "\r" in ctype
        or "\n" in ctype
    ):
        headers = {"Content-Type": ctype, **call.id_headers()}
        return web.Response(body=body, status=status, headers=headers)
    ids = b"X-Request-Id: %s\r\n" % call.req_id.encode()
    if call.client_id is not None:
        ids += b"X-Client-Request-Id: %s\r\n" % call.client_id.encode()
    transport.write(
        b"".join(
            (
                _status_line(status),
                b"Content-Type: %s\r\n" % ctype.encode("latin-1"),
                ids,
                _date_line(),
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
    )
    return Written(status=status)


@dataclass(frozen=True)
class Refusal:
    """An answer the front door gives instead of routing a request."""

    status: int
    message: str
    etype: str
    code: str | None = None  # the OpenAI error code, when not the status
    reason: str | None = None  # counted in hgxserve_proxy_refused_total{reason}
    retry_after: bool = False
    close: bool = False  # close the connection after the answer

    def answer(self) -> web.Response:
        resp = error_response(self.status, self.message, self.etype, self.code)
        if self.retry_after:
            resp.headers["Retry-After"] = "1"
        if self.close:
            resp.force_close()
        return resp


UNAUTHORIZED = Refusal(
    401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key"
)
NOT_JSON = Refusal(400, "Request body is not valid JSON.", "invalid_request_error")
NOT_AN_OBJECT = Refusal(400, "Request body must be a JSON object.", "invalid_request_error")
BODY_BUDGET_SPENT = Refusal(
    503,
    "The proxy holds too many request bodies; retry shortly.",
    "service_unavailable",
    reason="body_bytes",
    retry_after=True,
    close=True,
)


TOO_MANY_IN_FLIGHT = Refusal(
    429,
    "Too many requests in flight at the proxy; retry shortly.",
    "rate_limit",
    reason="in_flight",
    retry_after=True,
)


class BodyBudgetExceeded(Exception):
    """Request bodies in flight would pass `max_buffered_body_bytes`."""


class BodyHold:
    """The bytes of one request's body counted in `Metrics.buffered_body_bytes`, and its
    in-flight slot once the body is complete (`take_slot`)."""

    __slots__ = ("metrics", "held", "slot")

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.held = 0
        self.slot = False

    def take_slot(self, cap: int) -> bool:
        """Count the request in flight; False when `cap` requests already are."""
        if self.metrics.in_flight >= cap:
            return False
        self.metrics.in_flight += 1
        self.slot = True
        return True

    def add(self, size: int, budget: int) -> None:
        if self.metrics.buffered_body_bytes + size > budget:
            raise BodyBudgetExceeded()
        self.metrics.buffered_body_bytes += size
        self.held += size

    def release(self) -> None:
        self.metrics.buffered_body_bytes -= self.held
        self.held = 0
        if self.slot:
            self.metrics.in_flight -= 1
            self.slot = False


# what reading and parsing a body may raise, and the answer to each (first match)
_BODY_ERRORS = (
    web.HTTPRequestEntityTooLarge,
    BodyBudgetExceeded,
    TimeoutError,
    ValueError,
    HttpProcessingError,
)


def bearer_ok(request: web.BaseRequest, key: str | None) -> bool:
    """Whether `request` carries `key` as its Bearer token (always, when `key` is None),
    compared in constant time."""
    if key is None:
        return True
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    # surrogateescape: aiohttp decodes header bytes that way, so any token encodes back
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode("utf-8", "surrogateescape"), key.encode()
    )


class Admission:
    """Turns a generation request into a `Call`, or into the answer that refuses it."""

    def __init__(self, limits: Limits, metrics: Metrics, api_key: str | None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.api_key = api_key
        self.too_large = Refusal(
            413, f"Request body larger than {limits.max_body_bytes} bytes.", "invalid_request_error"
        )
        late = Refusal(
            408,
            f"Request body not received within {limits.body_timeout_s:g} s.",
            "invalid_request_error",
            reason="body_timeout",
            close=True,
        )
        self.body_refusals: tuple[tuple[type[BaseException], Refusal], ...] = (
            (web.HTTPRequestEntityTooLarge, self.too_large),
            (BodyBudgetExceeded, BODY_BUDGET_SPENT),
            (TimeoutError, late),
            (ValueError, NOT_JSON),
            (HttpProcessingError, NOT_JSON),
        )

    def authorized(self, request: web.BaseRequest) -> bool:
        return bearer_ok(request, self.api_key)

    def refuse(self, endpoint: str, refusal: Refusal) -> web.Response:
        """Count a refused request (route "none") and answer it."""
        if refusal.reason:
            self.metrics.refuse(refusal.reason)
        self.metrics.request("none", endpoint, refusal.status)
        return refusal.answer()

    async def admit(
        self, request: web.BaseRequest, path: str, endpoint: str, hold: BodyHold
    ) -> Call | web.Response:
        """The request as a `Call` once its key, size, arrival and JSON pass; else the answer
        that refuses it. The body's bytes stay counted in `hold` until the caller releases it.
        """
        if self.api_key is not None and not self.authorized(request):
            return self.refuse(endpoint, UNAUTHORIZED)
        length = request.content_length
        if length is not None and length > self.limits.max_body_bytes:
            return self.refuse(endpoint, self.too_large)
        try:
            # bytes straight to json.loads: no text decode, and `raw` is relayed as it came
            raw = await self.read_body(request, length, hold)
            body = parse_body(raw)
        except _BODY_ERRORS as exc:
            refusal = next(r for kinds, r in self.body_refusals if isinstance(exc, kinds))
            return self.refuse(endpoint, refusal)
        if not isinstance(body, dict):
            return self.refuse(endpoint, NOT_AN_OBJECT)
        if not hold.take_slot(self.limits.max_in_flight):
            return self.refuse(endpoint, TOO_MANY_IN_FLIGHT)
        raw, body = strip_transfer_fields(raw, body)
        sent = request.headers.get("X-Request-Id")
        return Call(
            request, path, raw, body, request_id(sent), time.perf_counter(), client_request_id(sent)
        )

    async def read_body(
        self, request: web.BaseRequest, length: int | None, hold: BodyHold
    ) -> bytes:
        """The whole body (`length`: its Content-Length), within `body_timeout_s`
        (TimeoutError otherwise).

        A body over SMALL_BODY_BYTES (or of unknown length) is read piece by piece and every
        byte received counts against `max_buffered_body_bytes` until the answer is done
        (BodyBudgetExceeded when it would pass it): memory follows what clients really sent,
        and slow clients cannot reserve it by announcing large bodies they never send.
        """
        limits = self.limits
        content = request.content
        if length is not None and length <= SMALL_BODY_BYTES:
            if content.is_eof():
                # already all here (the usual case): taken as it lies, no timer, no wait
                raw = content.read_nowait()
                if len(raw) > limits.max_body_bytes:  # (a compressed body, decompressed)
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=limits.max_body_bytes, actual_size=len(raw)
                    )
                return raw
            async with timeout(limits.body_timeout_s):
                return await request.read()
        # one growing buffer: past 128 KiB it lives in its own mapping, which goes back to the
        # system when the request ends (many small chunks would fragment the heap instead)
        body = bytearray()
        async with timeout(limits.body_timeout_s):
            while chunk := await content.readany():
                if len(body) + len(chunk) > limits.max_body_bytes:
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=limits.max_body_bytes, actual_size=len(body) + len(chunk)
                    )
                hold.add(len(chunk), limits.max_buffered_body_bytes)
                body += chunk
        return bytes(body)
