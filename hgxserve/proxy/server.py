"""The P/D proxy: one OpenAI-compatible endpoint in front of prefill, decode and combined engines.

    config = load_proxy_config("/etc/hgxserve/proxy.json")
    asyncio.run(serve(config))      # what `hgxserve proxy serve --config ...` runs

This module wires the parts together: the front door (frontdoor: connections, limits, auth,
admission), the balancer (balancer: instances, health, the route for a prompt), the P/D protocols
(pd), one call's relay to an engine (relay), the request body (body) and the metrics (metrics);
and retries a request on another engine while nothing has reached its client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web

from hgxserve.proxy.balancer import HealthChecker, Instance, Pool
from hgxserve.proxy.body import estimate_prompt_tokens
from hgxserve.proxy.config import ProxyConfig, read_api_key
from hgxserve.proxy.frontdoor import (
    UNAUTHORIZED,
    Admission,
    BodyHold,
    Call,
    Routes,
    bound_logs,
    error_response,
    front_door,
    return_large_buffers_to_the_system,
)
from hgxserve.proxy.metrics import Metrics
from hgxserve.proxy.pd import dispatch
from hgxserve.proxy.relay import Relay, UpstreamUnavailable
from hgxserve.proxy.upstream import Upstream

log = logging.getLogger("hgxserve.proxy")


class Proxy:
    """One proxy: its engines, front door, relay and metrics, and the routes clients call."""

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
        self.relay = Relay(self.upstream, self.metrics, limits)
        self.door = Admission(limits, self.metrics, self.api_key)
        self.checker_task: asyncio.Task[None] | None = None
        bound_logs()

    # ------------------------------------------------------------------ lifecycle

    def server(self) -> web.Server:
        """The front door's server for the five routes (capped ones count against
        `max_in_flight`; /health and /metrics never do)."""
        routes: Routes = {
            "/health": ("GET", self.health, False),
            "/metrics": ("GET", self.metrics_page, False),
            "/v1/models": ("GET", self.models, True),
            "/v1/completions": ("POST", self.completions, True),
            "/v1/chat/completions": ("POST", self.chat_completions, True),
        }
        return front_door(routes, self.config.limits, self.metrics)

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

    async def health(self, _request: web.BaseRequest) -> web.Response:
        if self.pool.routable():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "no healthy route"}, status=503)

    async def metrics_page(self, _request: web.BaseRequest) -> web.Response:
        return web.Response(
            text=self.metrics.render(self.pool), content_type="text/plain", charset="utf-8"
        )

    async def models(self, request: web.BaseRequest) -> web.Response:
        if not self.door.authorized(request):
            return UNAUTHORIZED.answer()
        assert self.session is not None
        decodes = [d for _, ds in self.pool.groups for d in ds]
        for inst in [i for i in self.pool.combined + decodes if i.healthy]:
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.health.timeout_s * 2)
                async with self.session.get(inst.url + "/v1/models", timeout=timeout) as up:
                    body = await up.read()
                    if up.status == 200:
                        return web.Response(body=body, content_type="application/json")
            except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError):
                self.metrics.upstream_error(inst, "connect")
        data = [{"id": self.config.served_model_name, "object": "model", "owned_by": "hgxserve"}]
        return web.json_response({"object": "list", "data": data})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self.generate(request, "/v1/completions", "completions")

    async def chat_completions(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self.generate(request, "/v1/chat/completions", "chat")

    async def generate(
        self, request: web.BaseRequest, path: str, endpoint: str
    ) -> web.StreamResponse:
        hold = BodyHold(self.metrics)
        try:
            call = await self.door.admit(request, path, endpoint, hold)
            if isinstance(call, web.StreamResponse):
                return call
            return await self.route(call, endpoint)
        finally:
            hold.release()

    async def route(self, call: Call, endpoint: str) -> web.StreamResponse:
        """Route `call` to the engines the balancer picks; on a failure before any byte reached
        the client, again to others (`max_retries`)."""
        tokens = estimate_prompt_tokens(call.body, self.config.routing.bytes_per_token)
        exclude: set[Instance] = set()
        attempts = 0
        route = "none"
        try:
            while True:
                decision = self.pool.decide(tokens, exclude)
                if decision is None:
                    return self.answered(route, endpoint, self.no_engine(tried=bool(exclude)))
                route = decision.route
                try:
                    resp = await dispatch(self.relay, self.config.protocol, call, decision)
                    return self.answered(route, endpoint, resp)
                except UpstreamUnavailable as exc:
                    exclude.add(exc.inst)
                    attempts += 1
                    stop = self.engine_failed(call, exc, attempts)
                    if stop is not None:
                        return self.answered(route, endpoint, stop)
                    self.metrics.retries += 1
        except asyncio.CancelledError:
            # the client went away; cancelling here closed the upstream connections
            self.metrics.disconnects += 1
            raise

    def answered(self, route: str, endpoint: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.request(route, endpoint, resp.status)
        return resp

    @staticmethod
    def no_engine(tried: bool) -> web.Response:
        if tried:
            # every engine left failed this one request: the request, not the engines
            return error_response(502, "Every engine tried failed before answering.", "bad_gateway")
        return error_response(
            503, "No healthy engine can serve this request.", "service_unavailable"
        )

    def engine_failed(
        self, call: Call, exc: UpstreamUnavailable, attempts: int
    ) -> web.Response | None:
        """Note an engine's failure; the client's answer when the request should not be tried
        again (a timeout, or `max_retries` spent), else None."""
        inst = exc.inst
        log.warning("request %s: %s %s failed: %s", call.req_id, inst.role, inst.url, exc)
        if exc.engine_down:
            self.pool.mark_down(inst, str(exc))
        if exc.timed_out:
            # waiting as long again elsewhere helps no one: say so at once
            return error_response(504, f"The {inst.role} engine did not answer in time.", "timeout")
        if attempts > self.config.routing.max_retries:
            return error_response(
                502, f"The {inst.role} engine failed before answering.", "bad_gateway"
            )
        return None


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
