"""The P/D proxy: one OpenAI-compatible endpoint in front of prefill, decode and combined engines.

    config = load_proxy_config("/etc/hgxserve/proxy.json")
    asyncio.run(serve(config))      # what `hgxserve proxy serve --config ...` runs

This module wires the parts together: the front door (frontdoor: connections, limits, auth,
admission), the balancer (balancer: instances, health, the route for a prompt), the P/D protocols
(pd), one call's relay to an engine (relay), the request body (body) and the metrics (metrics);
and retries a request on another engine while nothing has reached its client.

Stop, pause and reload (docs/proxy.md "Drain and reload"): SIGTERM drains (new requests get
503 + Retry-After while the listener stays open; requests in flight finish within
`limits.drain_timeout_s`; then it exits); SIGUSR1 pauses (the same refusal, but the proxy keeps
running: a release switch stops engines behind it); SIGHUP reloads proxy.json and admits again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from hgxserve.base.defaults import DRAIN_RETRY_AFTER_S
from hgxserve.proxy.balancer import HealthChecker, Instance, Pool
from hgxserve.proxy.config import (
    ProxyConfig,
    ProxyConfigError,
    load_proxy_config,
    read_api_key,
    restart_needed,
)
from hgxserve.proxy.frontdoor import (
    UNAUTHORIZED,
    Admission,
    BodyHold,
    Call,
    FrontDoor,
    Routes,
    bearer_ok,
    bound_logs,
    error_response,
    front_door,
    return_large_buffers_to_the_system,
)
from hgxserve.proxy.kvroute import Router
from hgxserve.proxy.metrics import Metrics
from hgxserve.proxy.pd import dispatch
from hgxserve.proxy.relay import Relay, UpstreamUnavailable
from hgxserve.proxy.upstream import Upstream

log = logging.getLogger("hgxserve.proxy")
SHUTDOWN_S = 1.0  # after the drain: the last bytes of answers already complete
IDLE_POLL_S = 0.05  # how often a drain looks at the requests still in flight
SERVING, PAUSED, DRAINING = "serving", "paused", "draining"


class Proxy:
    """One proxy: its engines, front door, relay and metrics, and the routes clients call."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pool = Pool(config)
        self.metrics = Metrics()
        self.router = Router(config, self.pool)
        self.metrics.extra = self.router.render
        self.api_key = read_api_key(config.api_key_file) if config.api_key_file else None
        self.upstream_key = (
            read_api_key(config.upstream_api_key_file) if config.upstream_api_key_file else None
        )
        # /metrics wants this key when set (read at start, like the others: restart-only)
        self.metrics_key = (
            read_api_key(config.metrics_key_file) if config.metrics_key_file else None
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
        self.front: FrontDoor | None = None
        self.state = SERVING  # paused or draining: new requests get 503 + Retry-After
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
        self.front = front_door(routes, self.config.limits, self.metrics)
        return self.front

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
        self.router.start()

    async def stop_checks(self) -> None:
        if self.checker_task:
            self.checker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.checker_task
            self.checker_task = None

    async def stop(self) -> None:
        await self.stop_checks()
        await self.router.stop()
        if self.session:
            await self.session.close()
        self.upstream.close()

    # ------------------------------------------------------------------ small endpoints

    # ------------------------------------------------------------------ drain, pause, reload

    def set_state(self, state: str) -> None:
        if state != self.state:
            log.info("proxy %s (was %s; %d requests in flight)", state, self.state,
                     self.metrics.in_flight)  # fmt: skip
        self.state = state
        self.metrics.draining = int(state != SERVING)

    def turned_away(self, endpoint: str) -> web.Response:
        """The answer to a request that arrives while paused or draining: 503 + Retry-After,
        before any byte of it reached an engine, so the client can safely send it again."""
        self.metrics.refuse(self.state)
        self.metrics.request("none", endpoint, 503)
        resp = error_response(
            503,
            f"The proxy is {self.state} for a restart or release; retry shortly.",
            "service_unavailable",
        )
        resp.headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)
        return resp

    async def wait_idle(self, bound_s: float) -> int:
        """Wait until no request is in flight or `bound_s` passed; the number still in flight."""
        deadline = time.monotonic() + bound_s
        while self.metrics.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(IDLE_POLL_S)
        return self.metrics.in_flight

    async def drain(self) -> None:
        """Stop admitting and let the requests in flight finish, within the drain bound."""
        self.set_state(DRAINING)
        bound = self.config.limits.drain_timeout_s
        started = time.monotonic()
        left = await self.wait_idle(bound)
        if left:
            log.warning("drain bound of %g s passed: cutting %d request(s) in flight", bound, left)
        else:
            log.info("drained in %.1f s: no request in flight", time.monotonic() - started)

    async def reload(self, path: str | Path) -> bool:
        """Read `path` again and route by it from now on (requests in flight keep their
        engines); a paused proxy admits again. An invalid file, or one that changes what only a
        restart can (`restart_needed`), leaves everything as it was, and says why."""
        try:
            new = load_proxy_config(path)
            key = read_api_key(new.api_key_file) if new.api_key_file else None
        except ProxyConfigError as exc:
            log.error("reload refused, the running configuration stays: %s", exc)
            return False
        needs = restart_needed(self.config, new)
        if needs:
            log.error("reload refused: %s change only with a restart", ", ".join(needs))
            return False
        pool = Pool(new)
        carry_health(self.pool, pool)
        await self.stop_checks()
        await self.router.stop()
        self.config, self.pool, self.api_key = new, pool, key
        self.router = Router(new, pool)
        self.metrics.extra = self.router.render
        self.router.start()
        self.relay = Relay(self.upstream, self.metrics, new.limits)
        self.door = Admission(new.limits, self.metrics, key)
        if self.front is not None:
            self.front.limits = new.limits
        assert self.session is not None
        self.checker_task = asyncio.create_task(HealthChecker(pool, self.session).run())
        log.info("reloaded %s: %d P/D groups, %d combined", path, len(new.pd_groups),
                 len(new.combined))  # fmt: skip
        self.set_state(SERVING)
        return True

    # ------------------------------------------------------------------ small endpoints

    async def health(self, _request: web.BaseRequest) -> web.Response:
        if self.state != SERVING:
            return web.json_response({"status": self.state}, status=503)
        if self.pool.routable():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "no healthy route"}, status=503)

    async def metrics_page(self, request: web.BaseRequest) -> web.Response:
        if not bearer_ok(request, self.metrics_key):
            # nothing in the body: a scraper without the key learns only that it needs one
            return web.Response(status=401, headers={"WWW-Authenticate": "Bearer"})
        return web.Response(
            text=self.metrics.render(self.pool), content_type="text/plain", charset="utf-8"
        )

    async def models(self, request: web.BaseRequest) -> web.Response:
        if self.state != SERVING:
            return self.turned_away("models")
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
        if self.state != SERVING:
            return self.turned_away(endpoint)
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
        router = self.router
        plan = router.plan(call.body, endpoint)
        exclude: set[Instance] = set()
        attempts = 0
        route = "none"
        try:
            while True:
                decision = router.decide(plan, exclude)
                if decision is None:
                    return self.answered(route, endpoint, self.no_engine(tried=bool(exclude)))
                route = decision.route
                router.begin(decision, plan)
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
                finally:
                    router.end(decision, plan)
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
        resp = error_response(
            503, "No healthy engine can serve this request.", "service_unavailable"
        )
        resp.headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)  # engines come back (a switch)
        return resp

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


def carry_health(old: Pool, new: Pool) -> None:
    """Engines in both pools keep their health in the new one (a reload must not take healthy
    engines out of rotation until their next check)."""
    known = {(i.role, i.url): i for i in old.instances}
    for inst in new.instances:
        before = known.get((inst.role, inst.url))
        if before is not None:
            inst.healthy, inst.reason, inst.since = before.healthy, before.reason, before.since
            inst.ok_streak, inst.fail_streak = before.ok_streak, before.fail_streak


class Signals:
    """What the proxy does on each signal: SIGTERM/SIGINT drain and exit (a second one exits
    at once), SIGUSR1 pauses, SIGHUP reloads `config_path`."""

    def __init__(self, proxy: Proxy, config_path: str | Path | None) -> None:
        self.proxy = proxy
        self.config_path = config_path
        self.exit = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.pauses = 0  # a later pause's own expiry replaces an earlier one's

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_stop)
        loop.add_signal_handler(signal.SIGINT, self.on_stop)
        loop.add_signal_handler(signal.SIGUSR1, self.on_pause)
        loop.add_signal_handler(signal.SIGHUP, self.on_reload)

    def spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_stop(self) -> None:
        if self.stopping:
            log.warning("second stop signal: exiting with %d request(s) in flight",
                        self.proxy.metrics.in_flight)  # fmt: skip
            self.exit.set()
            return
        self.stopping = True
        self.spawn(self.drain_then_exit())

    async def drain_then_exit(self) -> None:
        await self.proxy.drain()
        self.exit.set()

    def on_pause(self) -> None:
        if self.proxy.state == SERVING:
            self.proxy.set_state(PAUSED)
            self.pauses += 1
            self.spawn(self.resume_after(self.pauses, self.proxy.config.limits.pause_max_s))

    async def resume_after(self, pause: int, seconds: float) -> None:
        """Admit again once a pause outlived `seconds` with no reload or stop: the switch
        that paused the proxy never came (its controller died after the pause)."""
        await asyncio.sleep(seconds)
        if self.proxy.state == PAUSED and self.pauses == pause and not self.stopping:
            log.warning("paused for %.0f s and no release reloaded or stopped the proxy: "
                        "admitting requests again", seconds)  # fmt: skip
            self.proxy.set_state(SERVING)

    def on_reload(self) -> None:
        if self.config_path is None or self.stopping:
            return
        self.spawn(self.proxy.reload(self.config_path))


async def serve(config: ProxyConfig, config_path: str | Path | None = None) -> None:
    """Run the proxy until a stop signal drained it (`Signals`), or until cancelled.

    Example: asyncio.run(serve(load_proxy_config("proxy.json"), "proxy.json"))
    """
    return_large_buffers_to_the_system()
    proxy = Proxy(config)
    await proxy.start()
    # the drain already waited for requests in flight (Signals): what still runs then is cut
    runner = web.ServerRunner(proxy.server(), shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=2048, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        await proxy.stop()
        raise
    log.info(
        "hgxserve proxy listening on %s:%d (%s, %d P/D groups, %d combined, auth %s, /metrics %s)",
        config.host,
        config.port,
        config.protocol,
        len(config.pd_groups),
        len(config.combined),
        "on" if proxy.api_key else "off",
        "keyed" if proxy.metrics_key else "open",
    )
    signals = Signals(proxy, config_path)
    signals.install()
    try:
        await signals.exit.wait()
    finally:
        await runner.cleanup()
        await proxy.stop()
