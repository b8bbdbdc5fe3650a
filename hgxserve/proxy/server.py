"""The P/D proxy: one OpenAI-compatible endpoint in front of prefill, decode and combined engines.

    config = load_proxy_config("/etc/hgxserve/proxy.json")
    asyncio.run(serve(config))      # what `hgxserve proxy serve --config ...` runs

vLLM NIXL: prefill gets the body with stream=false, max_tokens=1 and kv_transfer_params
{do_remote_decode: true}; decode gets the original body plus the params prefill returned (or
none: first token was EOS, decode prefills locally). SGLang: prefill and decode get the same body
with bootstrap_host/port/room at once. Answers are relayed byte for byte: SSE chunks as they
arrive, JSON bodies untouched (reasoning_content, tool_calls and usage survive).

The front door (docs/proxy.md, "Front door"): request heads and bodies must arrive in time,
open connections, requests in flight and buffered body bytes are capped (503/429/503), a
client's own `kv_transfer_params` and `bootstrap_*` fields never reach an engine, only a failed
connection (or the health checks) takes an engine out of rotation, and warnings are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from hgxserve.proxy.balancer import Decision, HealthChecker, Instance, Pool
from hgxserve.proxy.config import ProxyConfig, read_api_key
from hgxserve.proxy.upstream import Response, Upstream, UpstreamError

log = logging.getLogger("hgxserve.proxy")
# aiohttp's server logs malformed requests here (with our bounds, not its tracebacks)
http_log = logging.getLogger("hgxserve.proxy.http")

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RETRYABLE_STATUS = (502, 503, 504)
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# Fields that tell an engine where to fetch or send KV: only the proxy sets them. A client's
# own would make a decode dial a host:port of the client's choosing.
TRANSFER_FIELDS = ("kv_transfer_params",)
TRANSFER_PREFIXES = ("bootstrap_",)
# X-Request-Id values passed on as they came; anything else gets a fresh id
LINGER_S = 2.0
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")
_REFUSED_BODY = (
    b'{"error":{"message":"Too many open connections to the proxy; retry shortly.",'
    b'"type":"service_unavailable","param":null,"code":503}}'
)
REFUSED_CONNECTION = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_REFUSED_BODY), _REFUSED_BODY)
)


def error_kind(exc: BaseException) -> str:
    return exc.kind if isinstance(exc, UpstreamError) else type(exc).__name__


def new_request_id() -> str:
    """A random 128-bit request id in hex (as uuid4().hex, at a fraction of its cost)."""
    return f"{random.getrandbits(128):032x}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# one decoder for every request (json.loads with arguments would build one per call)
_STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)


def parse_body(raw: bytes) -> Any:
    """The client's JSON; ValueError for anything that is not strict JSON (NaN, Infinity,
    invalid UTF-8, nesting deep enough to exhaust the parser).

    Example: parse_body(b'{"a": 1}') == {"a": 1}
    """
    try:
        # as json.loads does with bytes, then the strict decoder
        return _STRICT_JSON.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def strip_transfer_fields(raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The body without client-supplied KV transfer fields; the client's bytes when it had none.

    Example: strip_transfer_fields(b'{"kv_transfer_params":{}}', {"kv_transfer_params": {}})
             == (b'{}', {})
    """
    if not any(k in TRANSFER_FIELDS or k.startswith(TRANSFER_PREFIXES) for k in body):
        return raw, body
    clean = {
        k: v
        for k, v in body.items()
        if k not in TRANSFER_FIELDS and not k.startswith(TRANSFER_PREFIXES)
    }
    return json.dumps(clean, separators=(",", ":")).encode(), clean


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


def with_fields(raw: bytes, body: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """The client's JSON body with `extra` keys added, keeping the client's bytes when it can.

    Appending to the original bytes avoids re-encoding every prompt; a body that already has
    one of the keys (or is empty, or not plain UTF-8 JSON) is re-encoded instead.

    Example: with_fields(b'{"a": 1}', {"a": 1}, {"b": 2}) == b'{"a": 1,"b":2}'
    """
    if body and raw.lstrip()[:1] == b"{" and not any(k in body for k in extra):
        inner = json.dumps(extra, separators=(",", ":"))[1:-1].encode()
        return raw[: raw.rfind(b"}")] + b"," + inner + b"}"
    return json.dumps({**body, **extra}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Call:
    """One client request on its way through the proxy: what every step of routing needs."""

    request: web.BaseRequest
    path: str  # /v1/completions or /v1/chat/completions
    raw: bytes  # the body as the client sent it (relayed as is where possible)
    body: dict[str, Any]
    req_id: str
    started: float  # perf_counter when the proxy had read the body

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class UpstreamUnavailable(Exception):
    """An instance failed before any byte reached the client: safe to try another one.

    `engine_down`: no connection could be made, so the instance leaves rotation for everyone
    (the health checks readmit it). A timeout or a dropped request only concerns this request.
    """

    def __init__(self, inst: Instance, why: str, cause: BaseException | None = None) -> None:
        super().__init__(why)
        self.inst = inst
        self.engine_down = isinstance(cause, UpstreamError) and cause.connect_failed
        self.timed_out = isinstance(cause, TimeoutError)


class Metrics:
    """Counters and histograms, rendered as Prometheus text."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.upstream_errors: dict[tuple[str, str, str], int] = {}
        self.retries = 0
        self.disconnects = 0
        self.started = time.time()
        # P/D KV hand-offs by result: ok (prefill returned the KV to pull / answered), none
        # (vLLM prefill returned no kv_transfer_params: decode computes the prompt itself),
        # failed (prefill failed)
        self.kv_handoffs: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.open_connections = 0
        self.in_flight = 0
        self.buffered_body_bytes = 0
        self.added_ttft = [0] * (len(LATENCY_BUCKETS) + 1)
        self.added_sum = 0.0

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def request(self, route: str, endpoint: str, code: int) -> None:
        key = (route, endpoint, f"{code // 100}xx")
        self.requests[key] = self.requests.get(key, 0) + 1

    def upstream_error(self, inst: Instance, kind: str) -> None:
        key = (inst.role, inst.url, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def kv_handoff(self, result: str) -> None:
        self.kv_handoffs[result] = self.kv_handoffs.get(result, 0) + 1

    def observe_added_ttft(self, seconds: float) -> None:
        self.added_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.added_ttft[i] += 1
                return
        self.added_ttft[-1] += 1

    def render(self, pool: Pool) -> str:
        where = [({"role": i.role, "instance": i.url}, i) for i in pool.instances]
        acc, buckets = 0, []
        for bound, n in zip(LATENCY_BUCKETS, self.added_ttft, strict=False):
            acc += n
            buckets.append(({"le": str(bound)}, acc))
        acc += self.added_ttft[-1]
        buckets.append(({"le": "+Inf"}, acc))
        out: list[str] = []
        family(
            out,
            "hgxserve_proxy_requests_total",
            "counter",
            "Requests answered, by route and status class.",
            [
                ({"route": route, "endpoint": endpoint, "code": code}, n)
                for (route, endpoint, code), n in sorted(self.requests.items())
            ],
        )
        family(
            out,
            "hgxserve_proxy_upstream_errors_total",
            "counter",
            "Upstream failures by instance.",
            [
                ({"role": role, "instance": url, "kind": kind}, n)
                for (role, url, kind), n in sorted(self.upstream_errors.items())
            ],
        )
        family(
            out,
            "hgxserve_proxy_outstanding_requests",
            "gauge",
            "In-flight requests per instance.",
            [(w, i.outstanding) for w, i in where],
        )
        family(
            out,
            "hgxserve_proxy_instance_healthy",
            "gauge",
            "1 while the instance is in rotation.",
            [(w, int(i.healthy)) for w, i in where],
        )
        family(
            out,
            "hgxserve_proxy_instance_state_since_seconds",
            "gauge",
            "When the instance last went in or out of rotation (Unix time).",
            [(w, f"{i.since:.3f}") for w, i in where],
        )
        family(
            out,
            "hgxserve_proxy_instance_out_of_rotation",
            "gauge",
            "Instances out of rotation, with why.",
            [(w | {"reason": i.reason}, 1) for w, i in where if not i.healthy],
        )
        family(
            out,
            "hgxserve_proxy_kv_handoffs_total",
            "counter",
            "P/D requests by what the prefill handed to the decode: ok, none (no KV: decode "
            "computes the prompt), failed.",
            [({"result": result}, n) for result, n in sorted(self.kv_handoffs.items())],
        )
        family(
            out,
            "hgxserve_proxy_start_time_seconds",
            "gauge",
            "When this proxy started (Unix time).",
            [({}, f"{self.started:.3f}")],
        )
        family(
            out,
            "hgxserve_proxy_added_ttft_seconds",
            "histogram",
            "Time to first byte spent in the proxy itself (total minus time waiting on engines).",
            [],
        )
        name = "hgxserve_proxy_added_ttft_seconds"
        out += [sample(f"{name}_bucket", labels, n) for labels, n in buckets]
        out += [sample(f"{name}_count", {}, acc), sample(f"{name}_sum", {}, self.added_sum)]
        for name, kind, help_text, value in (
            (
                "hgxserve_proxy_retries_total",
                "counter",
                "Upstream attempts retried on another instance.",
                self.retries,
            ),
            (
                "hgxserve_proxy_client_disconnects_total",
                "counter",
                "Clients that went away before their answer was complete.",
                self.disconnects,
            ),
            (
                "hgxserve_proxy_open_connections",
                "gauge",
                "Client connections open now.",
                self.open_connections,
            ),
            (
                "hgxserve_proxy_in_flight_requests",
                "gauge",
                "Client requests being answered now.",
                self.in_flight,
            ),
            (
                "hgxserve_proxy_buffered_body_bytes",
                "gauge",
                "Request body bytes held in memory now (bounded by the front door's budget).",
                self.buffered_body_bytes,
            ),
        ):
            family(out, name, kind, help_text, [({}, value)])
        family(
            out,
            "hgxserve_proxy_refused_total",
            "counter",
            "Requests and connections turned away at the front door, by reason.",
            [({"reason": reason}, n) for reason, n in sorted(self.refused.items())],
        )
        return "\n".join(out) + "\n"


def sample(name: str, labels: dict[str, str], value: object) -> str:
    """One exposition line; every label value escaped (label_value)."""
    if not labels:
        return f"{name} {value}"
    inner = ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}"


def family(
    out: list[str],
    name: str,
    kind: str,
    help_text: str,
    samples: list[tuple[dict[str, str], object]],
) -> None:
    """Append one metric family to `out`: # HELP (when given), # TYPE, then its samples.

    family(out, "x_total", "counter", "Things.", [({"role": "decode"}, 3)])
    """
    if help_text:
        out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    out.extend(sample(name, labels, value) for labels, value in samples)


def label_value(text: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def estimate_prompt_tokens(body: dict[str, Any], bytes_per_token: float) -> int:
    """Cheap prompt length estimate: UTF-8 bytes / bytes_per_token (token ids counted exactly).

    Example: estimate_prompt_tokens({"prompt": "x" * 400}, 4.0) == 100
    """
    size = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        size = len(prompt.encode(errors="replace"))
    elif isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        size = sum(len(p.encode(errors="replace")) for p in prompt if isinstance(p, str))
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            size += len(content.encode(errors="replace"))
        elif isinstance(content, list):
            size += sum(
                len(str(p.get("text", "")).encode(errors="replace"))
                for p in content
                if isinstance(p, dict)
            )
    return int(size / bytes_per_token)


def error_response(status: int, message: str, etype: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": code or status}}
    return web.json_response(body, status=status)


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


# Bodies up to this size are read at once and not counted against max_buffered_body_bytes:
# the in-flight cap bounds them (2048 x 64 KiB = 128 MiB), and a prompt of 16K tokens fits.
SMALL_BODY_BYTES = 64 * 1024


class BodyBudgetExceeded(Exception):
    """Request bodies in flight would pass `max_buffered_body_bytes`."""


class BodyHold:
    """The bytes of one request's body counted in `Metrics.buffered_body_bytes`."""

    __slots__ = ("metrics", "held")

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.held = 0

    def add(self, size: int, budget: int) -> None:
        if self.metrics.buffered_body_bytes + size > budget:
            raise BodyBudgetExceeded()
        self.metrics.buffered_body_bytes += size
        self.held += size

    def release(self) -> None:
        self.metrics.buffered_body_bytes -= self.held
        self.held = 0


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
    a connection whose head is unfinished when it fires, idle or not).
    """

    def __init__(self, handler: Handler, *, max_connections: int, metrics: Metrics, **kw: Any):
        super().__init__(handler, **kw)
        self.max_connections = max_connections
        self.metrics = metrics

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.metrics.open_connections += 1

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.metrics.open_connections -= 1

    def __call__(self) -> Any:
        if self.metrics.open_connections >= self.max_connections:
            self.metrics.refuse("connections")
            return _Refused()
        return super().__call__()


class Proxy:
    """Request handling: auth, routing, the two P/D protocols, relaying, retries, metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pool = Pool(config)
        self.metrics = Metrics()
        self.api_key = read_api_key(config.api_key_file) if config.api_key_file else None
        self.upstream_key = (
            read_api_key(config.upstream_api_key_file) if config.upstream_api_key_file else None
        )
        # aiohttp for health checks and /v1/models; the lean pooled client for generation
        self.session: aiohttp.ClientSession | None = None
        limits = config.limits
        self.upstream = Upstream(
            connect_timeout=limits.connect_timeout_s,
            api_key=self.upstream_key,
            max_idle=limits.upstream_max_idle,
            idle_timeout=limits.upstream_idle_timeout_s,
        )
        self.checker_task: asyncio.Task[None] | None = None
        bound_logs()

    # ------------------------------------------------------------------ lifecycle

    def server(self) -> web.Server:
        """aiohttp's low-level server: five fixed routes need no router, app or middlewares.

        Routes marked capped count against `max_in_flight`; /health and /metrics never do,
        so probes still answer under load.
        """
        routes: dict[str, tuple[str, Handler, bool]] = {
            "/health": ("GET", self.health, False),
            "/metrics": ("GET", self.metrics_page, False),
            "/v1/models": ("GET", self.models, True),
            "/v1/completions": ("POST", self.completions, True),
            "/v1/chat/completions": ("POST", self.chat_completions, True),
        }
        limits = self.config.limits
        max_body = limits.max_body_bytes
        max_in_flight = limits.max_in_flight
        metrics = self.metrics
        loop = asyncio.get_running_loop()

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
            if metrics.in_flight >= max_in_flight:
                metrics.refuse("in_flight")
                resp = error_response(
                    429, "Too many requests in flight at the proxy; retry shortly.", "rate_limit"
                )
                resp.headers["Retry-After"] = "1"
                return resp
            metrics.in_flight += 1
            try:
                return await handler(request)
            except (asyncio.CancelledError, ConnectionError, web.HTTPException):
                raise
            except Exception as exc:
                # a defect, not the client's fault: one bounded line, never a traceback
                log.error("%s %s failed inside the proxy: %r", request.method, request.path, exc)
                if request.writer is not None and request.writer.output_size:
                    raise ConnectionResetError("answer already started") from None
                return error_response(500, "Internal proxy error.", "internal_error")
            finally:
                metrics.in_flight -= 1

        def make_request(
            message: Any, payload: Any, protocol: Any, writer: Any, task: Any
        ) -> web.BaseRequest:
            return web.BaseRequest(
                message, payload, protocol, writer, task, loop, client_max_size=max_body
            )

        # handler_cancellation: a client that disconnects cancels its handler, which closes
        # the upstream connections, so the engines abort the request
        return FrontDoor(
            handle,
            max_connections=limits.max_connections,
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

    async def start(self) -> None:
        # health checks and /v1/models only: a few connections per engine at most
        connector = aiohttp.TCPConnector(
            limit=100,
            ttl_dns_cache=300,
            keepalive_timeout=self.config.limits.upstream_idle_timeout_s,
        )
        headers = {"Authorization": f"Bearer {self.upstream_key}"} if self.upstream_key else None
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            headers=headers,
        )
        self.checker_task = asyncio.create_task(HealthChecker(self.pool, self.session).run())

    async def stop(self) -> None:
        if self.checker_task:
            self.checker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.checker_task
        if self.session:
            await self.session.close()
        self.upstream.close()

    # ------------------------------------------------------------------ small endpoints

    def authorized(self, request: web.BaseRequest) -> bool:
        if self.api_key is None:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        # surrogateescape: aiohttp decodes header bytes that way, so any token encodes back
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), self.api_key.encode()
        )

    async def health(self, _request: web.BaseRequest) -> web.Response:
        if self.pool.routable():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "no healthy route"}, status=503)

    async def metrics_page(self, _request: web.BaseRequest) -> web.Response:
        return web.Response(
            text=self.metrics.render(self.pool), content_type="text/plain", charset="utf-8"
        )

    async def models(self, request: web.BaseRequest) -> web.Response:
        if not self.authorized(request):
            return self.unauthorized()
        assert self.session is not None
        decodes = [d for _, ds in self.pool.groups for d in ds]
        for inst in [i for i in self.pool.combined + decodes if i.healthy]:
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.health.timeout_s * 2)
                async with self.session.get(inst.url + "/v1/models", timeout=timeout) as up:
                    body = await up.read()
                    if up.status == 200:
                        return web.Response(body=body, content_type="application/json")
            except (TimeoutError, aiohttp.ClientError):
                self.metrics.upstream_error(inst, "connect")
        data = [{"id": self.config.served_model_name, "object": "model", "owned_by": "hgxserve"}]
        return web.json_response({"object": "list", "data": data})

    def engine_refused_key(self, inst: Instance) -> web.Response:
        """An engine answered 401 to the proxy: a deployment fault, not the client's."""
        self.metrics.upstream_error(inst, "http_401")
        log.warning(
            "%s %s refused the proxy's engine key (auth.upstream_api_key_file)", inst.role, inst.url
        )
        return error_response(
            502, f"The {inst.role} engine refused the proxy's credentials.", "bad_gateway"
        )

    @staticmethod
    def unauthorized() -> web.Response:
        return error_response(
            401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key"
        )

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self.generate(request, "/v1/completions", "completions")

    async def chat_completions(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self.generate(request, "/v1/chat/completions", "chat")

    async def generate(
        self, request: web.BaseRequest, path: str, endpoint: str
    ) -> web.StreamResponse:
        if not self.authorized(request):
            self.metrics.request("none", endpoint, 401)
            return self.unauthorized()
        length = request.content_length
        if length is not None and length > self.config.limits.max_body_bytes:
            return self.body_too_large(endpoint)
        hold = BodyHold(self.metrics)
        try:
            return await self._generate(request, path, endpoint, hold)
        finally:
            hold.release()

    def body_too_large(self, endpoint: str) -> web.Response:
        self.metrics.request("none", endpoint, 413)
        limit = self.config.limits.max_body_bytes
        return error_response(
            413, f"Request body larger than {limit} bytes.", "invalid_request_error"
        )

    async def _read_body(self, request: web.BaseRequest, hold: BodyHold) -> bytes:
        """The whole body, within `body_timeout_s` (TimeoutError otherwise).

        A body over SMALL_BODY_BYTES (or of unknown length) is read piece by piece and every
        byte received counts against `max_buffered_body_bytes` until the answer is done
        (BodyBudgetExceeded when it would pass it): memory follows what clients really sent,
        and slow clients cannot reserve it by announcing large bodies they never send.
        """
        length = request.content_length
        content = request.content
        if length is not None and length <= SMALL_BODY_BYTES:
            if content.is_eof():
                return await request.read()  # already all here: no timer needed
            async with asyncio.timeout(self.config.limits.body_timeout_s):
                return await request.read()
        limits = self.config.limits
        # one growing buffer: past 128 KiB it lives in its own mapping, which goes back to the
        # system when the request ends (many small chunks would fragment the heap instead)
        body = bytearray()
        async with asyncio.timeout(limits.body_timeout_s):
            while chunk := await content.readany():
                if len(body) + len(chunk) > limits.max_body_bytes:
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=limits.max_body_bytes, actual_size=len(body) + len(chunk)
                    )
                hold.add(len(chunk), limits.max_buffered_body_bytes)
                body += chunk
        return bytes(body)

    async def _generate(
        self, request: web.BaseRequest, path: str, endpoint: str, hold: BodyHold
    ) -> web.StreamResponse:
        try:
            # bytes straight to json.loads: no text decode, and `raw` is relayed as it came
            raw = await self._read_body(request, hold)
            body = parse_body(raw)
        except web.HTTPRequestEntityTooLarge:
            return self.body_too_large(endpoint)
        except BodyBudgetExceeded:
            self.metrics.refuse("body_bytes")
            self.metrics.request("none", endpoint, 503)
            full = error_response(
                503,
                "The proxy holds too many request bodies; retry shortly.",
                "service_unavailable",
            )
            full.headers["Retry-After"] = "1"
            full.force_close()
            return full
        except TimeoutError:
            self.metrics.refuse("body_timeout")
            self.metrics.request("none", endpoint, 408)
            late = error_response(
                408,
                f"Request body not received within {self.config.limits.body_timeout_s:g} s.",
                "invalid_request_error",
            )
            late.force_close()
            return late
        except (ValueError, HttpProcessingError):
            self.metrics.request("none", endpoint, 400)
            return error_response(400, "Request body is not valid JSON.", "invalid_request_error")
        if not isinstance(body, dict):
            self.metrics.request("none", endpoint, 400)
            return error_response(
                400, "Request body must be a JSON object.", "invalid_request_error"
            )
        raw, body = strip_transfer_fields(raw, body)
        client_id = request.headers.get("X-Request-Id")
        req_id = client_id if client_id and REQUEST_ID.match(client_id) else new_request_id()
        tokens = estimate_prompt_tokens(body, self.config.routing.bytes_per_token)
        call = Call(request, path, raw, body, req_id, time.perf_counter())
        exclude: set[Instance] = set()
        attempts = 0
        route = "none"
        try:
            while True:
                decision = self.pool.decide(tokens, exclude)
                if decision is None and exclude:
                    # every engine left failed this one request: the request, not the engines
                    self.metrics.request(route, endpoint, 502)
                    return error_response(
                        502, "Every engine tried failed before answering.", "bad_gateway"
                    )
                if decision is None:
                    self.metrics.request(route, endpoint, 503)
                    return error_response(
                        503, "No healthy engine can serve this request.", "service_unavailable"
                    )
                route = decision.route
                try:
                    resp = await self.dispatch(call, decision)
                    self.metrics.request(route, endpoint, resp.status)
                    return resp
                except UpstreamUnavailable as exc:
                    inst = exc.inst
                    log.warning("request %s: %s %s failed: %s", req_id, inst.role, inst.url, exc)
                    if exc.engine_down:
                        self.pool.mark_down(inst, str(exc))
                    if exc.timed_out:
                        # waiting as long again elsewhere helps no one: say so at once
                        self.metrics.request(route, endpoint, 504)
                        return error_response(
                            504, f"The {inst.role} engine did not answer in time.", "timeout"
                        )
                    exclude.add(inst)
                    attempts += 1
                    if attempts > self.config.routing.max_retries:
                        self.metrics.request(route, endpoint, 502)
                        return error_response(
                            502, f"The {inst.role} engine failed before answering.", "bad_gateway"
                        )
                    self.metrics.retries += 1
        except asyncio.CancelledError:
            # the client went away; cancelling here closed the upstream connections
            self.metrics.disconnects += 1
            raise

    async def dispatch(self, call: Call, decision: Decision) -> web.StreamResponse:
        if decision.prefill is None:
            return await self.relay(call, decision.target, call.raw, 0.0)
        if self.config.protocol == "vllm-nixl":
            return await self.vllm_nixl(call, decision)
        return await self.sglang(call, decision)

    async def vllm_nixl(self, call: Call, decision: Decision) -> web.StreamResponse:
        assert decision.prefill is not None
        prefill = decision.prefill
        body, raw = call.body, call.raw
        prefill_body = dict(body)
        prefill_body.update(stream=False, max_tokens=1, max_completion_tokens=1)
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)
        prefill_body["kv_transfer_params"] = PREFILL_KV_PARAMS
        t0 = time.perf_counter()
        prefill.outstanding += 1
        prefill.picked += 1
        payload = json.dumps(prefill_body, separators=(",", ":")).encode()
        try:
            up = await self.upstream.post(
                prefill.url,
                call.path,
                payload,
                call.req_id,
                total_timeout=self.config.limits.prefill_timeout_s,
            )
            try:
                data = await up.read()
            finally:
                up.release()
        except (TimeoutError, UpstreamError) as exc:
            self.metrics.upstream_error(prefill, error_kind(exc))
            self.metrics.kv_handoff("failed")
            raise UpstreamUnavailable(prefill, f"prefill unreachable: {exc!r}", exc) from exc
        finally:
            prefill.outstanding -= 1
        if up.status in RETRYABLE_STATUS or up.status >= 500:
            self.metrics.upstream_error(prefill, f"http_{up.status}")
            self.metrics.kv_handoff("failed")
            raise UpstreamUnavailable(prefill, f"prefill answered HTTP {up.status}")
        if up.status == 401:
            return self.engine_refused_key(prefill)
        if up.status != 200:
            # the request itself is wrong (too long, unknown model): say so, once
            return web.Response(body=data, status=up.status, content_type="application/json")
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        self.metrics.kv_handoff("ok" if params else "none")
        # no params: the first token was EOS (or the prefill has no connector), so the decode
        # prefills locally; the client's own params were stripped on the way in
        decode_raw = with_fields(raw, body, {"kv_transfer_params": params}) if params else raw
        return await self.relay(call, decision.target, decode_raw, time.perf_counter() - t0)

    async def sglang(self, call: Call, decision: Decision) -> web.StreamResponse:
        assert decision.prefill is not None
        prefill = decision.prefill
        body, raw = call.body, call.raw
        bootstrap = {
            "bootstrap_host": prefill.endpoint.bootstrap_host,
            "bootstrap_port": prefill.endpoint.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }
        pd_raw = with_fields(raw, body, bootstrap)
        prefill_raw = json.dumps(
            {**body, **bootstrap, "stream": False}, separators=(",", ":")
        ).encode()
        prefill.outstanding += 1
        prefill.picked += 1

        async def run_prefill() -> int:
            try:
                up = await self.upstream.post(
                    prefill.url,
                    call.path,
                    prefill_raw,
                    call.req_id,
                    total_timeout=self.config.limits.prefill_timeout_s,
                )
                try:
                    await up.read()
                finally:
                    up.release()
                if up.status >= 500:
                    self.metrics.upstream_error(prefill, f"http_{up.status}")
                self.metrics.kv_handoff("ok" if up.status == 200 else "failed")
                return up.status
            except (TimeoutError, UpstreamError) as exc:
                self.metrics.upstream_error(prefill, error_kind(exc))
                self.metrics.kv_handoff("failed")
                raise UpstreamUnavailable(prefill, f"prefill unreachable: {exc!r}", exc) from exc
            finally:
                prefill.outstanding -= 1

        prefill_task = asyncio.create_task(run_prefill())
        try:
            return await self.relay(call, decision.target, pd_raw, 0.0, watch=prefill_task)
        finally:
            if not prefill_task.done():
                prefill_task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await prefill_task

    async def relay(
        self,
        call: Call,
        inst: Instance,
        payload: bytes,
        waited: float,
        watch: asyncio.Task[int] | None = None,
    ) -> web.StreamResponse:
        """Send `payload` (JSON) to the engine whose answer the client gets; pass the answer on.
        `waited`: seconds already spent on a prefill before this engine was asked.

        Raises UpstreamUnavailable only while nothing has been sent to the client.
        """
        req_id = call.req_id
        inst.outstanding += 1
        inst.picked += 1
        t_send = time.perf_counter()
        send = self.upstream.post(
            inst.url, call.path, payload, req_id, read_timeout=self.config.limits.read_timeout_s
        )
        try:
            try:
                up = await self._headers(send, watch)
            except (TimeoutError, UpstreamError) as exc:
                self.metrics.upstream_error(inst, error_kind(exc))
                raise UpstreamUnavailable(inst, f"unreachable: {exc!r}", exc) from exc
            try:
                if up.status in RETRYABLE_STATUS:
                    self.metrics.upstream_error(inst, f"http_{up.status}")
                    raise UpstreamUnavailable(inst, f"answered HTTP {up.status}")
                if up.status == 401:
                    return self.engine_refused_key(inst)
                ctype = up.headers.get("content-type", "application/json")
                if call.stream and up.status == 200:
                    return await self._stream(call, inst, up, ctype, waited, t_send)
                try:
                    data = await up.read()
                except (TimeoutError, UpstreamError) as exc:
                    self.metrics.upstream_error(inst, error_kind(exc))
                    raise UpstreamUnavailable(inst, f"answer cut off: {exc!r}", exc) from exc
                engine = (time.perf_counter() - t_send) + waited
                added = time.perf_counter() - call.started - engine
                self.metrics.observe_added_ttft(max(0.0, added))
                resp = web.Response(
                    body=data,
                    status=up.status,
                    headers={"Content-Type": ctype, "X-Request-Id": req_id},
                )
                return resp
            finally:
                up.release()
        finally:
            inst.outstanding -= 1

    async def _headers(
        self, post: Coroutine[Any, Any, Response], watch: asyncio.Task[int] | None
    ) -> Response:
        """Wait for the upstream's response headers; give up early if the watched prefill fails."""
        if watch is None:
            return await post
        send = asyncio.ensure_future(post)
        try:
            done, _ = await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
            if send not in done and watch.exception() is not None:
                exc = watch.exception()
                assert isinstance(exc, UpstreamUnavailable)
                raise exc
            return await send
        finally:
            if not send.done():
                send.cancel()
                with contextlib.suppress(BaseException):
                    (await send).release()

    async def _stream(
        self, call: Call, inst: Instance, up: Response, ctype: str, waited: float, t_send: float
    ) -> web.StreamResponse:
        request, req_id = call.request, call.req_id
        out = web.StreamResponse(
            status=200,
            headers={"Content-Type": ctype, "Cache-Control": "no-cache", "X-Request-Id": req_id},
        )
        first = True
        try:
            async for chunk in up.chunks():
                if first:
                    now = time.perf_counter()
                    engine = (now - t_send) + waited
                    await out.prepare(request)
                    self.metrics.observe_added_ttft(max(0.0, now - call.started - engine))
                    first = False
                await out.write(chunk)
        except (TimeoutError, UpstreamError) as exc:
            # (a client that went away while we wrote to it raises ConnectionError: not here)
            self.metrics.upstream_error(inst, error_kind(exc))
            if first:
                raise UpstreamUnavailable(
                    inst, f"stream failed before a byte: {exc!r}", exc
                ) from exc
            # bytes already reached the client: never retried; say so in the stream
            log.warning("request %s: %s %s broke mid-stream: %r", req_id, inst.role, inst.url, exc)
            err = {
                "error": {
                    "message": f"upstream {inst.role} failed mid-stream",
                    "type": "upstream_error",
                    "code": 502,
                }
            }
            with contextlib.suppress(ConnectionError):
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        if first:
            await out.prepare(request)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out


# glibc mallopt(M_MMAP_THRESHOLD): a fixed threshold also turns off its adaptive one
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_large_buffers_to_the_system() -> None:
    """Keep every allocation over 128 KiB (request bodies) in its own mapping, unmapped when
    freed. glibc's adaptive threshold moves such buffers into the heap after the first ones are
    freed, and a burst of large bodies then stays in the process long after it ended (the soak
    benchmark: 249 MiB kept after the attackers left, 75 MiB with this)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


async def serve(config: ProxyConfig) -> None:
    """Run the proxy until cancelled (SIGTERM/SIGINT stop it cleanly under `hgxserve proxy`).

    Example: asyncio.run(serve(load_proxy_config("proxy.json")))
    """
    return_large_buffers_to_the_system()
    proxy = Proxy(config)
    await proxy.start()
    runner = web.ServerRunner(proxy.server())
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=2048, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        await proxy.stop()
        raise
    log.info(
        "hgxserve proxy listening on %s:%d (%s, %d P/D groups, %d combined, auth %s)",
        config.host,
        config.port,
        config.protocol,
        len(config.pd_groups),
        len(config.combined),
        "on" if proxy.api_key else "off",
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await proxy.stop()
