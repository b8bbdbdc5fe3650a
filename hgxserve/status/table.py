"""The compact table `hgxserve status` prints for people (`--json` prints the report itself)."""

from __future__ import annotations

import time
from typing import Any

from hgxserve.status.report import HostView, Report, _engine_names_by_url, _span, pending_deadline
from hgxserve.topology import Topology


def _clock(stamp: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp)) if stamp else "-"


def _short(unit: str) -> str:
    """`hgxserve-decode-0.service` -> `decode-0`."""
    return unit.removeprefix("hgxserve-").removesuffix(".service")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> `0-3,6`."""
    spans: list[list[int]] = []
    for index in sorted(indices):
        if spans and spans[-1][1] == index - 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "-"


def _tokens(value: int) -> str:
    """1760000 -> `1.76M`, 4096 -> `4096`."""
    return f"{value / 1e6:.2f}M" if value >= 1_000_000 else str(value)


def _observed_cells(observed: dict[str, Any] | None) -> list[str]:
    """STARTED IN and KV for an engine: its start time, and the KV capacity it reported (per DP
    rank) with the ratio to the fit estimate and the verdict against the shapes' need."""
    if not observed:
        return ["-", "-"]
    started = f"{observed['start_s']:.0f}s" if observed.get("start_s") is not None else "-"
    tokens = observed.get("kv_tokens")
    if tokens is None:
        return [started, "not reported"]
    kv = f"{_tokens(int(tokens))} tok"
    if observed.get("kv_fit_ratio") is not None:
        kv += f" ({observed['kv_fit_ratio']:.2f}x fit)"
    if observed.get("kv_verdict") == "short":
        kv += f" SHORT of {_tokens(int(observed.get('kv_need_tokens') or 0))}"
    return [started, kv]


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _release_cell(view: HostView, now: float) -> tuple[str, str]:
    release = (view.snapshot or {}).get("release") or {}
    running = release.get("running")
    if release.get("pending"):
        deadline = pending_deadline(release)
        left = f"reverts {_clock(deadline)} (in {_span(deadline - now)})" if deadline else "?"
        return f"{running} pending", left
    if not running:
        return "none", "-"
    mark = "" if running == view.expected_release else " (not this topology's)"
    links = [k for k in ("previous", "baseline") if release.get(k) == running]
    state = "current" + (f"={'='.join(links)}" if links else "")
    return f"{running} {state}{mark}", "-"


def _weights_cell(view: HostView) -> str:
    weights = (view.snapshot or {}).get("weights")
    if not weights:
        return "-"
    marker = weights.get("marker")
    if not marker:
        return "NO MARKER"
    short = marker.split(":", 1)[-1][:12]
    return f"{short} {'ok' if weights.get('intact') else 'CHANGED'}"


def _cache_cell(view: HostView) -> str:
    caches = (view.snapshot or {}).get("caches") or {}
    if not caches:
        return "-"
    cells = []
    for key, state in caches.items():
        how = "restored" if state.get("restored") else "baked" if state.get("baked") else (
            "empty" if state.get("present") else "absent")  # fmt: skip
        cells.append(f"{key.rsplit('-', 1)[-1][:8]} {how}")
    return ", ".join(cells)


def _percent(text: str | None) -> int | None:
    """`87%` -> 87; `N/A` (MIG) -> None."""
    value = (text or "").rstrip("%")
    return int(value) if value.isdigit() else None


def _gpu_line(view: HostView) -> str:
    gpus = (view.snapshot or {}).get("gpus") or {}
    if gpus.get("status") != "ok":
        return gpus.get("error") or gpus.get("status") or "-"
    groups: list[tuple[str, list[dict[str, Any]]]] = []
    for gpu in gpus.get("gpus") or []:
        owners = sorted({_short(p["unit"]) if p.get("unit") else f"pid {p['pid']}"
                         for p in gpu.get("processes") or []})  # fmt: skip
        owner = "+".join(owners) or "free"
        if groups and groups[-1][0] == owner:
            groups[-1][1].append(gpu)
        else:
            groups.append((owner, [gpu]))
    parts = []
    for owner, members in groups:
        used = sum(g.get("memory_used_mib") or 0 for g in members)
        total = sum(g.get("memory_total_mib") or 0 for g in members)
        utils = [_percent(g.get("utilization")) for g in members]
        known = [u for u in utils if u is not None]
        util = f" util {max(known)}%" if known and owner != "free" else ""
        mem = f" {used // 1024}/{total // 1024} GiB" if owner != "free" else ""
        parts.append(f"{_ranges([g['index'] for g in members])} {owner}{mem}{util}")
    return "; ".join(parts) or "no GPUs"


def render(report: Report, topo: Topology) -> str:
    """The people's table: hosts, units, GPUs, the proxy, then the problems."""
    now = report.checked_at
    answered = sum(1 for v in report.hosts.values() if v.snapshot is not None)
    lines = [
        f"{report.topology}  {report.verdict.upper()}  {answered}/{len(report.hosts)} hosts "
        f"answered in {report.elapsed_s:.1f} s  {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "",
    ]
    rows = [["HOST", "ADDRESS", "RELEASE", "PENDING", "WEIGHTS", "CACHE"]]
    for view in report.hosts.values():
        if view.snapshot is None:
            why = (view.error or "").removeprefix("unreachable: ")
            head = "UNREACHABLE" if not view.reachable else "NO ANSWER"
            rows.append([view.name, view.address, f"{head}: {why}", "", "", ""])
            continue
        release, pending = _release_cell(view, now)
        rows.append(
            [view.name, view.address, release, pending, _weights_cell(view), _cache_cell(view)]
        )
    lines += _grid(rows)
    units = [["UNIT", "HOST", "ACTIVE", "HEALTH", "RESTARTS", "SINCE", "GPUS", "STARTED IN", "KV"]]
    for view in report.hosts.values():
        for unit in (view.snapshot or {}).get("units") or []:
            active = f"{unit.get('active')}/{unit.get('sub')}"
            health = unit.get("health") or ("-" if unit.get("kind") == "worker" else "?")
            units.append(
                [
                    _short(unit["name"]),
                    view.name,
                    active,
                    health,
                    str(unit.get("restarts", 0)),
                    _clock(unit.get("since")),
                    _ranges(unit.get("gpus") or []),
                    *_observed_cells(unit.get("observed")),
                ]
            )
    if len(units) > 1:
        lines += ["", *_grid(units)]
    gpu_rows = [["GPUS", "OWNER, MEMORY, UTILISATION"]]
    for view in report.hosts.values():
        if view.snapshot is not None:
            gpu_rows.append([view.name, _gpu_line(view)])
    if len(gpu_rows) > 1:
        lines += ["", *_grid(gpu_rows)]
    lines += _multinode_lines(report, topo)
    lines += _proxy_lines(report, topo)
    shown = [p for p in report.problems if p.severity != "warning"]
    warnings = [p for p in report.problems if p.severity == "warning"]
    if shown or warnings:
        lines += ["", "PROBLEMS" if shown else "WARNINGS"]
        lines += [f"  {p.line()}" for p in shown]
        lines += [f"  warning: {p.line()}" for p in warnings]
    return "\n".join(lines)


def _proxy_lines(report: Report, topo: Topology) -> list[str]:
    if topo.proxy is None:
        return []
    view = report.hosts.get(topo.proxy.host)
    proxy = (view.snapshot or {}).get("proxy") if view else None
    if not proxy:
        return []
    head = f"PROXY {topo.proxy.host} {proxy.get('url')}"
    if proxy.get("error"):
        return ["", f"{head}: {proxy['error']}"]
    if proxy.get("started"):
        head += f"  up since {_clock(proxy['started'])}"
    names = _engine_names_by_url(topo)
    rows = [["ENGINE", "ROLE", "ROTATION", "OUTSTANDING", "UPSTREAM ERRORS", "WHY OUT"]]
    for inst in proxy.get("instances") or []:
        rows.append(
            [
                names.get(inst["url"], inst["url"]),
                inst.get("role") or "?",
                "in" if inst.get("in_rotation") else "OUT",
                str(inst.get("outstanding", 0)),
                str(inst.get("upstream_errors", 0)),
                "" if inst.get("in_rotation") else inst.get("reason", ""),
            ]
        )
    lines = ["", head, *_grid(rows)]
    handoffs = proxy.get("kv_handoffs") or {}
    kv = [f"{k} {v}" for k, v in handoffs.items()]
    pulled = _decode_transfers(report, topo)
    if kv or pulled:
        parts = ["hand-offs " + (", ".join(kv) or "none"), *pulled]
        lines.append("KV since start: " + "; ".join(parts))
    decisions = proxy.get("decisions") or {}
    if decisions:
        lines.append("Routing since start: " + ", ".join(f"{k} {v}" for k, v in decisions.items()))
    return lines


def _decode_transfers(report: Report, topo: Topology) -> list[str]:
    """`<decode> transfers N, failed M` for each decode engine whose unit reports KV counters."""
    pulled = []
    for name, engine in topo.engines.items():
        if engine.role != "decode":
            continue
        host = report.hosts.get(engine.head)
        for unit in (host.snapshot or {}).get("units") or [] if host else []:
            metrics = unit.get("metrics") or {}
            if _short(unit["name"]) == name and "kv_transfers" in metrics:
                pulled.append(
                    f"{name} transfers {metrics['kv_transfers']:.0f}, "
                    f"failed {metrics.get('kv_failed', 0):.0f}"
                )
    return pulled


def _event_cell(event: dict[str, Any] | None) -> str:
    """`engine-down 12:01:02 (worker ... is failed)`."""
    if not event:
        return "-"
    why = event.get("reason") or ""
    return f"{event.get('kind')} {_clock(event.get('at'))}" + (f" ({why})" if why else "")


def _multinode_lines(report: Report, topo: Topology) -> list[str]:
    """Each engine that spans hosts as one row: its hosts, each host's part, and its watcher
    (the head host's, which restarts it as a whole): generation, restarts, last event."""
    rows = [["ENGINE", "HOSTS", "PARTS", "WATCHER", "RESTARTS", "LAST EVENT"]]
    for name, engine in topo.engines.items():
        if not engine.is_multi_node:
            continue
        parts, watch = [], None
        for host in engine.hosts:
            view = report.hosts.get(host)
            units = {u["name"]: u for u in ((view.snapshot or {}) if view else {}).get("units")
                     or []}  # fmt: skip
            unit = units.get(f"hgxserve-{name}.service") or {}
            parts.append(f"{host} {unit.get('active', '?')}")
            if host == engine.head:
                watch = (units.get(f"hgxserve-{name}-watch.service") or {}).get("watch")
        events = (watch or {}).get("events") or []
        downs = [e for e in events if e.get("kind") == "engine-down"]
        last = _event_cell(events[-1] if events else None)
        if downs and events[-1] is not downs[-1]:
            last += f" after {_event_cell(downs[-1])}"  # the story: what went down, and why
        rows.append(
            [
                name,
                "+".join(engine.hosts),
                ", ".join(parts),
                f"gen {watch.get('generation')} {watch.get('phase')}" if watch else "NOT RUNNING",
                f"{watch.get('restarts', 0)} restarts" if watch else "-",
                last,
            ]
        )
    return ["", *_grid(rows)] if len(rows) > 1 else []
