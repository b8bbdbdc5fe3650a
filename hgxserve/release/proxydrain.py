"""The hgxserve proxy across a switch (docs/releases.md "Drain, never cut"): it is paused and
drained before any engine behind it stops, and reloaded instead of restarted when only its
proxy.json changed.

    plan = proxy_plan(store, old, new, keep)     # which proxies reload, which pause first
    pause(unit, systemd, log)                    # 503 + Retry-After, in-flight requests finish

A paused proxy keeps listening: a client that arrives during the switch gets 503 with
Retry-After, not a refused or reset connection; requests already in flight finish (within the
proxy's drain bound) before the engines stop. `systemctl reload` (SIGHUP) makes it read the new
proxy.json and admit again.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hgxserve.base.paths import FIREWALL_FILE, PROXY_CONFIG, UNIT_DIR
from hgxserve.proxy.config import ProxyConfigError, parse_proxy_config, restart_needed
from hgxserve.proxy.scrape import metrics_headers
from hgxserve.release.store import ReleaseSpec, Store, UnitSpec

IN_FLIGHT = re.compile(r"^hgxserve_proxy_in_flight_requests (\d+)", re.M)
METRICS_MAX_BYTES = 4 * 1024 * 1024  # a proxy's /metrics page: a few KiB per engine
POLL_S = 0.25  # how often a drain reads the proxy's requests in flight
Log = Callable[[str], None]


class Signals(Protocol):
    """The systemctl calls a drain needs (hgxserve.release.switch.Systemd)."""

    def state(self, unit: str) -> str: ...

    def signal(self, unit: str, signal: str) -> None: ...


def drains(unit: UnitSpec) -> bool:
    """An hgxserve proxy that drains, pauses and reloads (its drain bound is in the release)."""
    return unit.kind == "proxy" and unit.drain_s is not None


def in_flight(health_url: str | None) -> int | None:
    """Requests in flight at the proxy (its /metrics), or None when it cannot be read."""
    if health_url is None:
        return None
    url = health_url.rsplit("/", 1)[0] + "/metrics"
    try:
        req = urllib.request.Request(url, headers=metrics_headers())
        with urllib.request.urlopen(req, timeout=3) as resp:
            text = resp.read(METRICS_MAX_BYTES).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    match = IN_FLIGHT.search(text)
    return int(match.group(1)) if match else None


def pause(unit: UnitSpec, systemd: Signals, log: Log) -> None:
    """Pause a running proxy (SIGUSR1) and wait until nothing is in flight, or its drain bound
    passed; then engines behind it may stop."""
    if systemd.state(unit.name) != "active":
        return
    bound = unit.drain_s or 0.0
    log(
        f"pausing {unit.name}: new requests get 503 + Retry-After; requests in flight get up "
        f"to {bound:g}s to finish"
    )
    systemd.signal(unit.name, "SIGUSR1")
    started = time.monotonic()
    deadline = started + bound
    left = in_flight(unit.health_url)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = in_flight(unit.health_url)
    took = time.monotonic() - started
    if left:
        log(f"{unit.name}: drain bound passed after {took:.1f}s, {left} request(s) still in flight")
    else:
        log(f"{unit.name}: drained in {took:.1f}s (nothing in flight)")


def _file(store: Store, spec: ReleaseSpec, path: str) -> bytes | None:
    if path not in spec.files:
        return None
    file = store.release_dir(spec.id) / "tree" / path.lstrip("/")
    return file.read_bytes() if file.is_file() else None


def _proxy_config(store: Store, spec: ReleaseSpec) -> Any:
    raw = _file(store, spec, PROXY_CONFIG)
    if raw is None:
        return None
    try:
        return parse_proxy_config(json.loads(raw))
    except (ValueError, ProxyConfigError):
        return None


def reloads(store: Store, old: ReleaseSpec, new: ReleaseSpec, unit: UnitSpec) -> bool:
    """Whether the running proxy `unit` of `old` can take `new` by a reload: same unit (spec
    and file), only proxy.json changed, and none of what a reload cannot change
    (hgxserve.proxy.config.restart_needed)."""
    before = {u.name: u for u in old.units}.get(unit.name)
    path = f"{UNIT_DIR}/{unit.name}"
    if before != unit or not drains(unit):
        return False
    text = _file(store, new, path)
    if text is None or _file(store, old, path) != text:
        return False
    others = (set(old.files) | set(new.files)) - {path, PROXY_CONFIG, FIREWALL_FILE}
    if any(
        _file(store, old, p) != _file(store, new, p)
        for p in others
        if not p.startswith(f"{UNIT_DIR}/")
    ):
        return False
    was, becomes = _proxy_config(store, old), _proxy_config(store, new)
    return was is not None and becomes is not None and not restart_needed(was, becomes)


@dataclass(frozen=True)
class ProxyPlan:
    """What a switch does with the proxies: `reload` run on (reloaded, not restarted, once
    the engines are up); `pause` are paused and drained before anything stops."""

    reload: frozenset[str]
    pause: tuple[UnitSpec, ...]


def proxy_plan(
    store: Store, old: ReleaseSpec | None, new: ReleaseSpec, keep: frozenset[str]
) -> ProxyPlan:
    """Pause the running proxies that will stop, and every one when an engine of this host
    stops or starts (one not in `keep`); reload those whose change a reload covers, and the
    paused ones that run on unchanged (a reload admits again)."""
    if old is None:
        return ProxyPlan(frozenset(), ())
    reload = {u.name for u in new.units if u.name not in keep and reloads(store, old, new, u)}
    engines_move = any(
        u.kind != "proxy" and u.name not in keep for spec in (old, new) for u in spec.units
    )
    pause = tuple(
        u
        for u in old.units
        if drains(u) and (engines_move or (u.name not in keep and u.name not in reload))
    )
    reload |= {u.name for u in pause if u.name in keep}
    return ProxyPlan(frozenset(reload), pause)
