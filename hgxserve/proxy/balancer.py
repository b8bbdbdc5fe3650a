"""Engine instances, their health, and the routing decision (P/D pair, combined, fallback).

pool = Pool(load_proxy_config("proxy.json"))
decision = pool.decide(prompt_tokens=3000)   # Decision(route="pd", prefill=..., decode=...)
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from hgxserve.base.compat import TIMEOUT_ERRORS
from hgxserve.proxy.config import Endpoint, ProxyConfig

log = logging.getLogger("hgxserve.proxy")


class Instance:
    """One engine the proxy talks to, with the load and health it has seen."""

    def __init__(self, endpoint: Endpoint, role: str, group: str) -> None:
        self.endpoint = endpoint
        self.url = endpoint.url
        self.role = role  # prefill | decode | combined
        self.group = group
        self.name = urlsplit(endpoint.url).netloc
        self.outstanding = 0
        self.picked = 0
        # prompt + answer-bound tokens of the requests in flight here (hgxserve.proxy.kvroute)
        self.inflight_tokens = 0
        # called as the instance leaves rotation (the KV indexes forget its cache)
        self.on_eject: Callable[[Instance], None] | None = None
        self.healthy = False
        self.ok_streak = 0
        self.fail_streak = 0
        # why the instance is out of rotation (shown by /metrics and `hgxserve status`), and
        # since when it is in or out
        self.reason = "not admitted yet: no passing health check since the proxy started"
        self.since = time.time()

    def set_healthy(self, healthy: bool, reason: str = "") -> bool:
        """Move the instance in or out of rotation; True when that changed its state."""
        if not healthy:
            self.reason = reason
        if healthy == self.healthy:
            return False
        self.healthy = healthy
        self.since = time.time()
        if healthy:
            self.reason = ""
        elif self.on_eject is not None:
            self.on_eject(self)
        return True

    def sort_key(self) -> tuple[int, int]:
        # least outstanding first; among equals the one picked least often, so idle
        # instances take turns instead of the first one taking every request
        return (self.outstanding, self.picked)

    def __repr__(self) -> str:
        return f"<{self.role} {self.url} healthy={self.healthy} out={self.outstanding}>"


@dataclass
class Decision:
    """Where one request goes. `prefill` is None for a single-engine route."""

    route: str  # pd | pd-local (decode prefills itself) | combined | fallback
    target: Instance  # the engine whose answer reaches the client
    prefill: Instance | None = None
    # why (hgxserve.proxy.kvroute): cache-hit, load, no-cache, overflow, ...; "" by length
    reason: str = ""


class Pool:
    """All instances of one proxy, grouped as the configuration says."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.groups: list[tuple[list[Instance], list[Instance]]] = []
        self.combined = [Instance(e, "combined", "combined") for e in config.combined]
        for g in config.pd_groups:
            prefills = [Instance(e, "prefill", g.name) for e in g.prefill]
            decodes = [Instance(e, "decode", g.name) for e in g.decode]
            self.groups.append((prefills, decodes))
        self.instances: list[Instance] = list(self.combined)
        for prefills, decodes in self.groups:
            self.instances += prefills + decodes

    @staticmethod
    def _least(cands: list[Instance], exclude: set[Instance]) -> Instance | None:
        live = [i for i in cands if i.healthy and i not in exclude]
        return min(live, key=Instance.sort_key) if live else None

    def _pair(self, exclude: set[Instance]) -> tuple[Instance, Instance] | None:
        best: tuple[Instance, Instance] | None = None
        for prefills, decodes in self.groups:
            p = self._least(prefills, exclude)
            d = self._least(decodes, exclude)
            if (
                p
                and d
                and (
                    best is None
                    or (d.sort_key(), p.sort_key()) < (best[1].sort_key(), best[0].sort_key())
                )
            ):
                best = (p, d)
        return best

    def decide(self, prompt_tokens: int, exclude: set[Instance] | None = None) -> Decision | None:
        """Pick the route for a prompt of this many tokens, skipping `exclude`d instances.

        Example: pool.decide(100) -> Decision(route="combined", target=<combined ...>)
        """
        exclude = exclude or set()
        routing = self.config.routing
        wants_pd = bool(self.groups) and (
            prompt_tokens >= routing.pd_min_prompt_tokens or not self.combined
        )
        if wants_pd:
            pair = self._pair(exclude)
            if pair:
                return Decision("pd", target=pair[1], prefill=pair[0])
            if routing.fallback_to_combined:
                c = self._least(self.combined, exclude)
                if c:
                    return Decision("fallback", target=c)
        else:
            c = self._least(self.combined, exclude)
            if c:
                return Decision("combined", target=c)
            pair = self._pair(exclude)
            if pair:
                return Decision("fallback", target=pair[1], prefill=pair[0])
        if self.config.protocol == "vllm-nixl":
            # a NIXL decode engine can prefill locally: slower, but it answers
            decodes = [d for _, ds in self.groups for d in ds]
            d = self._least(decodes, exclude)
            if d:
                return Decision("fallback", target=d)
        return None

    def routable(self) -> bool:
        return self.decide(0) is not None or self.decide(1 << 30) is not None

    def mark_down(self, inst: Instance, why: str) -> None:
        """Eject an instance at once after a failed connection (active checks readmit it)."""
        inst.ok_streak = 0
        inst.fail_streak = max(inst.fail_streak, self.config.health.unhealthy_after)
        if inst.set_healthy(False, f"request failed: {why}"):
            log.warning("ejected %s %s: %s", inst.role, inst.url, why)


class HealthChecker:
    """Polls every instance's non-generating health path; ejects and readmits on streaks."""

    def __init__(self, pool: Pool, session: aiohttp.ClientSession) -> None:
        self.pool = pool
        self.session = session
        self.health = pool.config.health

    async def check(self, inst: Instance) -> None:
        why = ""
        try:
            timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
            async with self.session.get(inst.url + self.health.path, timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    why = f"HTTP {resp.status}"
        except TIMEOUT_ERRORS:
            why = f"no answer within {self.health.timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            why = _connect_error(exc)
        if not why:
            inst.ok_streak += 1
            inst.fail_streak = 0
            if not inst.healthy and inst.ok_streak >= self.health.healthy_after:
                inst.set_healthy(True)
                log.info("admitted %s %s", inst.role, inst.url)
        else:
            inst.fail_streak += 1
            inst.ok_streak = 0
            reason = f"{inst.fail_streak} failed health check(s) of {self.health.path}: {why}"
            if inst.healthy and inst.fail_streak >= self.health.unhealthy_after:
                inst.set_healthy(False, reason)
                log.warning("ejected %s %s: %s", inst.role, inst.url, reason)
            elif not inst.healthy:
                inst.reason = reason

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.check(i) for i in self.pool.instances))
            await asyncio.sleep(self.health.interval_s)


def _connect_error(exc: BaseException) -> str:
    """A short reason for a failed health check: `connection refused`, `no route to host`."""
    inner = getattr(exc, "os_error", None) or exc
    code = getattr(inner, "errno", None)
    if code:
        return os.strerror(code).lower()
    return str(inner) or type(inner).__name__
