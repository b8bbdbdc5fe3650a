"""The P/D proxy: one OpenAI-compatible endpoint in front of prefill, decode and combined engines.

    config = load_proxy_config("/etc/hgxserve/proxy.json")
    asyncio.run(serve(config))      # what `hgxserve proxy serve --config ...` runs

vLLM NIXL: prefill gets the body with stream=false, max_tokens=1 and kv_transfer_params
{do_remote_decode: true}; decode gets the original body plus the params prefill returned (or
none: first token was EOS, decode prefills locally). SGLang: prefill and decode get the same body
with bootstrap_host/port/room at once. Answers are relayed byte for byte: SSE chunks as they
arrive, JSON bodies untouched (reasoning_content, tool_calls and usage survive).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from hgxserve.proxy.balancer import Decision, HealthChecker, Instance, Pool
from hgxserve.proxy.config import ProxyConfig, read_api_key
from hgxserve.proxy.upstream import Response, Upstream, UpstreamError

log = logging.getLogger("hgxserve.proxy")

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


def error_kind(exc: BaseException) -> str:
    return exc.kind if isinstance(exc, UpstreamError) else type(exc).__name__


def new_request_id() -> str:
    """A random 128-bit request id in hex (as uuid4().hex, at a fraction of its cost)."""
    return f"{random.getrandbits(128):032x}"


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
    """An instance failed before any byte reached the client: safe to try another one."""

    def __init__(self, inst: Instance, why: str) -> None:
        super().__init__(why)
        self.inst = inst


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
        self.added_ttft = [0] * (len(LATENCY_BUCKETS) + 1)
        self.added_sum = 0.0

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
        out = [
            "# HELP hgxserve_proxy_requests_total Requests answered, by route and status class.",
            "# TYPE hgxserve_proxy_requests_total counter",
        ]
        for (route, endpoint, code), n in sorted(self.requests.items()):
            out.append(
                f'hgxserve_proxy_requests_total{{route="{route}",endpoint="{endpoint}",'
                f'code="{code}"}} {n}'
            )
        out += [
            "# HELP hgxserve_proxy_upstream_errors_total Upstream failures by instance.",
            "# TYPE hgxserve_proxy_upstream_errors_total counter",
        ]
        for (role, url, kind), n in sorted(self.upstream_errors.items()):
            out.append(
                f'hgxserve_proxy_upstream_errors_total{{role="{role}",instance="{url}",'
                f'kind="{kind}"}} {n}'
            )
        out += [
            "# HELP hgxserve_proxy_outstanding_requests In-flight requests per instance.",
            "# TYPE hgxserve_proxy_outstanding_requests gauge",
        ]
        for i in pool.instances:
            out.append(
                f'hgxserve_proxy_outstanding_requests{{role="{i.role}",instance="{i.url}"}} '
                f"{i.outstanding}"
            )
        out += [
            "# HELP hgxserve_proxy_instance_healthy 1 while the instance is in rotation.",
            "# TYPE hgxserve_proxy_instance_healthy gauge",
        ]
        for i in pool.instances:
            out.append(
                f'hgxserve_proxy_instance_healthy{{role="{i.role}",instance="{i.url}"}} '
                f"{int(i.healthy)}"
            )
        out += [
            "# HELP hgxserve_proxy_instance_state_since_seconds When the instance last went"
            " in or out of rotation (Unix time).",
            "# TYPE hgxserve_proxy_instance_state_since_seconds gauge",
        ]
        for i in pool.instances:
            out.append(
                f'hgxserve_proxy_instance_state_since_seconds{{role="{i.role}",'
                f'instance="{i.url}"}} {i.since:.3f}'
            )
        out += [
            "# HELP hgxserve_proxy_instance_out_of_rotation Instances out of rotation, with why.",
            "# TYPE hgxserve_proxy_instance_out_of_rotation gauge",
        ]
        for i in pool.instances:
            if not i.healthy:
                out.append(
                    f'hgxserve_proxy_instance_out_of_rotation{{role="{i.role}",'
                    f'instance="{i.url}",reason="{label_value(i.reason)}"}} 1'
                )
        out += [
            "# HELP hgxserve_proxy_kv_handoffs_total P/D requests by what the prefill handed"
            " to the decode: ok, none (no KV: decode computes the prompt), failed.",
            "# TYPE hgxserve_proxy_kv_handoffs_total counter",
        ]
        for result, n in sorted(self.kv_handoffs.items()):
            out.append(f'hgxserve_proxy_kv_handoffs_total{{result="{result}"}} {n}')
        out += [
            "# HELP hgxserve_proxy_start_time_seconds When this proxy started (Unix time).",
            "# TYPE hgxserve_proxy_start_time_seconds gauge",
            f"hgxserve_proxy_start_time_seconds {self.started:.3f}",
        ]
        out += [
            "# HELP hgxserve_proxy_added_ttft_seconds Time to first byte spent in the proxy"
            " itself (total minus time waiting on engines).",
            "# TYPE hgxserve_proxy_added_ttft_seconds histogram",
        ]
        acc = 0
        for bound, n in zip(LATENCY_BUCKETS, self.added_ttft, strict=False):
            acc += n
            out.append(f'hgxserve_proxy_added_ttft_seconds_bucket{{le="{bound}"}} {acc}')
        acc += self.added_ttft[-1]
        out.append(f'hgxserve_proxy_added_ttft_seconds_bucket{{le="+Inf"}} {acc}')
        out.append(f"hgxserve_proxy_added_ttft_seconds_count {acc}")
        out.append(f"hgxserve_proxy_added_ttft_seconds_sum {self.added_sum}")
        out += [
            "# TYPE hgxserve_proxy_retries_total counter",
            f"hgxserve_proxy_retries_total {self.retries}",
            "# TYPE hgxserve_proxy_client_disconnects_total counter",
            f"hgxserve_proxy_client_disconnects_total {self.disconnects}",
        ]
        return "\n".join(out) + "\n"


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
        size = len(prompt.encode())
    elif isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        size = sum(len(p.encode()) for p in prompt if isinstance(p, str))
    for msg in body.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            size += sum(
                len(str(p.get("text", "")).encode()) for p in content if isinstance(p, dict)
            )
    return int(size / bytes_per_token)


def error_response(status: int, message: str, etype: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": code or status}}
    return web.json_response(body, status=status)


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class Proxy:
    """Request handling: auth, routing, the two P/D protocols, relaying, retries, metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pool = Pool(config)
        self.metrics = Metrics()
        self.api_key = read_api_key(config.api_key_file) if config.api_key_file else None
        # aiohttp for health checks and /v1/models; the lean pooled client for generation
        self.session: aiohttp.ClientSession | None = None
        self.upstream = Upstream(connect_timeout=config.limits.connect_timeout_s)
        self.checker_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def server(self) -> web.Server:
        """aiohttp's low-level server: five fixed routes need no router, app or middlewares."""
        routes: dict[str, tuple[str, Handler]] = {
            "/health": ("GET", self.health),
            "/metrics": ("GET", self.metrics_page),
            "/v1/models": ("GET", self.models),
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat_completions),
        }
        max_body = self.config.limits.max_body_bytes
        loop = asyncio.get_running_loop()

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            route = routes.get(request.path)
            if route is None:
                return error_response(404, "Not found.", "not_found_error")
            method, handler = route
            if request.method != method and not (method == "GET" and request.method == "HEAD"):
                resp = error_response(405, f"Use {method}.", "invalid_request_error")
                resp.headers["Allow"] = method
                return resp
            return await handler(request)

        def make_request(
            message: Any, payload: Any, protocol: Any, writer: Any, task: Any
        ) -> web.BaseRequest:
            return web.BaseRequest(
                message, payload, protocol, writer, task, loop, client_max_size=max_body
            )

        # handler_cancellation: a client that disconnects cancels its handler, which closes
        # the upstream connections, so the engines abort the request
        return web.Server(
            handle, request_factory=make_request, handler_cancellation=True, access_log=None
        )

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
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
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
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
        try:
            # bytes straight to json.loads: no text decode, and `raw` is relayed as it came
            raw = await request.read()
            body = json.loads(raw)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.request("none", endpoint, 413)
            limit = self.config.limits.max_body_bytes
            return error_response(
                413, f"Request body larger than {limit} bytes.", "invalid_request_error"
            )
        except ValueError:
            self.metrics.request("none", endpoint, 400)
            return error_response(400, "Request body is not valid JSON.", "invalid_request_error")
        if not isinstance(body, dict):
            self.metrics.request("none", endpoint, 400)
            return error_response(
                400, "Request body must be a JSON object.", "invalid_request_error"
            )
        req_id = request.headers.get("X-Request-Id") or new_request_id()
        tokens = estimate_prompt_tokens(body, self.config.routing.bytes_per_token)
        call = Call(request, path, raw, body, req_id, time.perf_counter())
        exclude: set[Instance] = set()
        attempts = 0
        route = "none"
        try:
            while True:
                decision = self.pool.decide(tokens, exclude)
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
                    self.pool.mark_down(exc.inst, str(exc))
                    exclude.add(exc.inst)
                    attempts += 1
                    log.warning(
                        "request %s: %s %s failed: %s", req_id, exc.inst.role, exc.inst.url, exc
                    )
                    if attempts > self.config.routing.max_retries:
                        self.metrics.request(route, endpoint, 502)
                        return error_response(
                            502, f"Upstream {exc.inst.role} failed: {exc}", "bad_gateway"
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
            raise UpstreamUnavailable(prefill, f"prefill unreachable: {exc!r}") from exc
        finally:
            prefill.outstanding -= 1
        if up.status in RETRYABLE_STATUS or up.status >= 500:
            self.metrics.upstream_error(prefill, f"http_{up.status}")
            self.metrics.kv_handoff("failed")
            raise UpstreamUnavailable(prefill, f"prefill answered HTTP {up.status}")
        if up.status != 200:
            # the request itself is wrong (too long, unknown model): say so, once
            return web.Response(body=data, status=up.status, content_type="application/json")
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        self.metrics.kv_handoff("ok" if params else "none")
        if params:
            decode_raw = with_fields(raw, body, {"kv_transfer_params": params})
        elif "kv_transfer_params" in body:
            # first token was EOS (or the prefill has no connector): decode prefills locally
            decode_body = dict(body)
            decode_body.pop("kv_transfer_params", None)
            decode_raw = json.dumps(decode_body, separators=(",", ":")).encode()
        else:
            decode_raw = raw
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
                raise UpstreamUnavailable(prefill, f"prefill unreachable: {exc!r}") from exc
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
                raise UpstreamUnavailable(inst, f"unreachable: {exc!r}") from exc
            try:
                if up.status in RETRYABLE_STATUS:
                    self.metrics.upstream_error(inst, f"http_{up.status}")
                    raise UpstreamUnavailable(inst, f"answered HTTP {up.status}")
                ctype = up.headers.get("content-type", "application/json")
                if call.stream and up.status == 200:
                    return await self._stream(call, inst, up, ctype, waited, t_send)
                try:
                    data = await up.read()
                except (TimeoutError, UpstreamError) as exc:
                    self.metrics.upstream_error(inst, error_kind(exc))
                    raise UpstreamUnavailable(inst, f"answer cut off: {exc!r}") from exc
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
                raise UpstreamUnavailable(inst, f"stream failed before a byte: {exc!r}") from exc
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


async def serve(config: ProxyConfig) -> None:
    """Run the proxy until cancelled (SIGTERM/SIGINT stop it cleanly under `hgxserve proxy`).

    Example: asyncio.run(serve(load_proxy_config("proxy.json")))
    """
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
