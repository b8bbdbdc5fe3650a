"""Compare what every host answered (`hgxserve inspect`) with what the topology says they run.

`build_report` returns a `Report`: one `HostView` per topology host (its answer and what the
topology expects of it) and the problems found, each naming the host and the part, with the
verdict and exit status of `hgxserve status`:

- 0 healthy: every host runs the topology's release, confirmed, every unit active and healthy,
  no drift, the proxy has every engine in rotation, the weights marker matches;
- 1 degraded: anything else the hosts reported (each problem says what);
- 2 could not tell: a host was unreachable or could not answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hgxserve.caches.key import cache_key
from hgxserve.release.plan import plan_release
from hgxserve.topology import Topology
from hgxserve.topology.model import S3Source
from hgxserve.topology.placement import serving_tree
from hgxserve.topology.ports import engine_url

Severity = Literal["unknown", "degraded", "warning"]
EXIT_HEALTHY, EXIT_DEGRADED, EXIT_UNKNOWN = 0, 1, 2
VERDICTS = {EXIT_HEALTHY: "healthy", EXIT_DEGRADED: "degraded", EXIT_UNKNOWN: "unknown"}


@dataclass
class Problem:
    """One thing that is not as the topology says; `host` None for topology-wide ones."""

    severity: Severity
    host: str | None
    part: str  # release | unit name | drift | gpu N | weights | cache | proxy | ssh
    message: str

    def line(self) -> str:
        where = f"{self.host}: " if self.host else ""
        return f"{where}{self.message}"


@dataclass
class HostView:
    """A host as `status` shows it: reachable or not, its answer, what the topology expects."""

    name: str
    address: str
    reachable: bool
    error: str | None = None
    elapsed_s: float = 0.0
    expected_release: str | None = None
    expected_units: list[str] = field(default_factory=list)
    snapshot: dict[str, Any] | None = None


@dataclass
class Report:
    topology: str
    topology_file: str
    checked_at: float
    hosts: dict[str, HostView]
    problems: list[Problem]
    elapsed_s: float = 0.0

    @property
    def exit_code(self) -> int:
        severities = {p.severity for p in self.problems}
        if "unknown" in severities:
            return EXIT_UNKNOWN
        if "degraded" in severities:
            return EXIT_DEGRADED
        return EXIT_HEALTHY

    @property
    def verdict(self) -> str:
        return VERDICTS[self.exit_code]

    def to_json(self) -> str:
        data = {
            "topology": self.topology,
            "topology_file": self.topology_file,
            "checked_at": self.checked_at,
            "elapsed_s": round(self.elapsed_s, 3),
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "problems": [asdict(p) for p in self.problems],
            "hosts": {name: asdict(view) for name, view in self.hosts.items()},
        }
        return json.dumps(data, indent=2, sort_keys=True)


# ------------------------------------------------------------------------------- expectations


def inspect_argv(topo: Topology, host: str, agent: str) -> list[str]:
    """The one read-only command `status` runs on `host`."""
    argv = [agent, "inspect", "--cache-root", topo.cache.root]
    engines = topo.engines_on(host)
    if engines:
        # the tree the engines read and its marker, where the weights stage wrote it
        tree, state_dir = serving_tree(topo.model)
        argv += ["--model-path", tree]
        if state_dir:
            argv += ["--weights-state-dir", state_dir]
        for engine in engines:
            argv += ["--cache-key", cache_key(topo, engine)]
    return argv


def expected_source(topo: Topology) -> str | None:
    source = topo.model.source
    return source.url if isinstance(source, S3Source) else None


# ------------------------------------------------------------------------------- checks


def _ago(stamp: float | None, now: float) -> str:
    if not stamp:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(stamp)) + f" ({_span(now - stamp)} ago)"


def _span(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def pending_deadline(release: dict[str, Any]) -> float | None:
    """When the pending switch reverts unless confirmed: the dead-man timer's own next elapse,
    else the deadline the switch wrote into pending.json."""
    pending = release.get("pending") or {}
    timer = release.get("deadman") or {}
    fires_at = timer.get("fires_at") if timer.get("armed") else None
    deadline = fires_at or pending.get("deadline")
    return float(deadline) if deadline else None


def _check_release(view: HostView, snap: dict[str, Any], now: float) -> list[Problem]:
    host = view.name
    release = snap.get("release") or {}
    problems = []
    running = release.get("running")
    if release.get("error"):
        problems.append(Problem("degraded", host, "release", release["error"]))
    if running != view.expected_release and (running or view.expected_units):
        what = f"runs release {running} ({release.get('topology')})" if running else (
            "runs no release")  # fmt: skip
        problems.append(
            Problem(
                "degraded",
                host,
                "release",
                f"{what}, not this topology's release {view.expected_release} (not deployed)",
            )
        )
    pending = release.get("pending")
    if pending:
        deadline = pending_deadline(release)
        when = (
            f"reverts at {time.strftime('%H:%M:%S', time.localtime(deadline))} "
            f"(in {_span(deadline - now)}) unless confirmed"
            if deadline
            else "no revert deadline known"
        )
        armed = (release.get("deadman") or {}).get("armed")
        if deadline and not armed:
            when += "; the dead-man timer is NOT armed"
        problems.append(
            Problem("degraded", host, "release", f"switch to {pending.get('id')} pending: {when}")
        )
    return problems


def _check_units(view: HostView, snap: dict[str, Any]) -> list[Problem]:
    host = view.name
    problems = []
    for unit in snap.get("units") or []:
        problems += _unit_problems(host, unit)
    drift = snap.get("drift") or {}
    for path in drift.get("modified") or []:
        problems.append(
            Problem("degraded", host, "drift", f"{path} differs from the release's copy (drift)")
        )
    for path in drift.get("missing") or []:
        problems.append(
            Problem("degraded", host, "drift", f"{path} of the release is missing (drift)")
        )
    for unit in drift.get("stray_units") or []:
        problems.append(
            Problem("degraded", host, "drift", f"{unit} runs but is not in the release (drift)")
        )
    return problems


def _unit_problems(host: str, unit: dict[str, Any]) -> list[Problem]:
    """One unit: not active (and how it ended), failing health, changed on disk, unreadable."""
    name = unit["name"]
    problems = []
    if unit.get("active") != "active":
        problems.append(Problem("degraded", host, name, f"{name} is {_inactive_detail(unit)}"))
    elif unit.get("health") == "failing":
        problems.append(
            Problem(
                "degraded",
                host,
                name,
                f"{name} is active but its health check fails: {unit.get('health_detail')}",
            )
        )
    if unit.get("need_reload"):
        problems.append(
            Problem(
                "degraded",
                host,
                "drift",
                f"{name}: unit file changed on disk since systemd loaded it (drift)",
            )
        )
    if unit.get("error"):
        problems.append(Problem("degraded", host, name, f"{name}: {unit['error']}"))
    observed = unit.get("observed") or {}
    if observed.get("kv_verdict") == "short":  # released under gate.kv_capacity: warn
        problems.append(Problem("warning", host, name, f"KV capacity: {observed['kv_message']}"))
    return problems


def _inactive_detail(unit: dict[str, Any]) -> str:
    detail = f"{unit.get('active')} ({unit.get('sub')})"
    if unit.get("result") not in (None, "", "success"):
        detail += f", result {unit['result']}"
    if unit.get("exit_status"):
        detail += f", exit status {unit['exit_status']}"
    if unit.get("restarts"):
        detail += f", restarted {unit['restarts']} times"
    return detail


def _containerised(topo: Topology, unit: str) -> bool:
    engine = topo.engines.get(unit.removeprefix("hgxserve-").removesuffix(".service"))
    return bool(engine and engine.runtime and engine.runtime.is_container)


def _check_gpus(topo: Topology, view: HostView, snap: dict[str, Any]) -> list[Problem]:
    host = view.name
    gpus = snap.get("gpus") or {}
    if gpus.get("status") == "error":
        return [Problem("degraded", host, "gpu", f"nvidia-smi failed: {gpus.get('error')}")]
    if gpus.get("status") != "ok":
        if view.expected_units and any(u.get("gpus") for u in snap.get("units") or []):
            return [Problem("degraded", host, "gpu", "nvidia-smi is not installed")]
        return []
    owner = {g: u["name"] for u in snap.get("units") or [] for g in u.get("gpus") or []}
    problems = []
    for gpu in gpus.get("gpus") or []:
        index = gpu["index"]
        for proc in gpu.get("processes") or []:
            unit = proc.get("unit")
            if unit and unit.endswith(".scope") and _containerised(topo, owner.get(index, "")):
                continue  # the container runtime's scope: the engine's container holds it
            if index in owner and unit != owner[index]:
                held_by = f"{unit}" if unit else "a process outside any hgxserve unit"
                problems.append(
                    Problem(
                        "degraded",
                        host,
                        f"gpu {index}",
                        f"GPU {index} of {owner[index]} is held by {held_by} "
                        f"(pid {proc.get('pid')}, {proc.get('used_memory_mib')} MiB)",
                    )
                )
            elif index not in owner and unit and unit.startswith("hgxserve-"):
                problems.append(
                    Problem(
                        "degraded",
                        host,
                        f"gpu {index}",
                        f"GPU {index} is held by {unit}, which the release does not give it",
                    )
                )
    return problems


def _check_weights(
    topo: Topology, view: HostView, snap: dict[str, Any], digest: str | None
) -> list[Problem]:
    weights = snap.get("weights")
    if not topo.engines_on(view.name) or weights is None:
        return []
    host = view.name
    problems = []
    if not weights.get("marker"):
        problems.append(Problem("degraded", host, "weights", weights.get("detail") or "no marker"))
    elif not weights.get("intact"):
        problems.append(Problem("degraded", host, "weights", weights.get("detail") or ""))
    elif digest and weights["marker"] != digest:
        problems.append(
            Problem(
                "degraded",
                host,
                "weights",
                f"{weights['path']} is verified for {weights['marker']}, not {digest}",
            )
        )
    source = expected_source(topo)
    if source and weights.get("source") and weights["source"] != source:
        problems.append(
            Problem(
                "degraded",
                host,
                "weights",
                f"{weights['path']} was synced from {weights['source']}, the topology says "
                f"{source}",
            )
        )
    return problems


def _check_caches(topo: Topology, view: HostView, snap: dict[str, Any]) -> list[Problem]:
    if topo.cache.policy != "bake":
        return []
    problems = []
    for key, state in (snap.get("caches") or {}).items():
        if not (state.get("restored") or state.get("baked")):
            problems.append(
                Problem(
                    "degraded",
                    view.name,
                    "cache",
                    f"cache key {key} is not present (policy bake): engines compile at start",
                )
            )
    return problems


def _engine_names_by_url(topo: Topology) -> dict[str, str]:
    return {engine_url(topo, e): e.name for e in topo.engines.values()}


def _check_proxy(topo: Topology, view: HostView, snap: dict[str, Any], now: float) -> list[Problem]:
    if topo.proxy is None or topo.proxy.host != view.name:
        return []
    host = view.name
    proxy = snap.get("proxy")
    if proxy is None:
        return []  # no proxy unit in the running release: the release check says so
    if proxy.get("error"):
        return [Problem("degraded", host, "proxy", f"proxy /metrics: {proxy['error']}")]
    if not proxy.get("known"):
        return [
            Problem("warning", host, "proxy", "the proxy does not report rotation (not hgxserve's)")
        ]
    names = _engine_names_by_url(topo)
    problems = []
    seen = set()
    for inst in proxy.get("instances") or []:
        name = names.get(inst["url"], inst["url"])
        seen.add(name)
        if inst.get("in_rotation") is False:
            problems.append(
                Problem(
                    "degraded",
                    host,
                    "proxy",
                    f"proxy has {name} ({inst['url']}) out of rotation since "
                    f"{_ago(inst.get('since'), now)}: {inst.get('reason') or 'no reason given'}",
                )
            )
    targets = set(topo.proxy.combined) | {
        n for r in topo.proxy.routes for n in (*r.prefill, *r.decode)
    }
    for name in sorted(targets - seen):
        problems.append(
            Problem("degraded", host, "proxy", f"proxy does not know engine {name} (stale config)")
        )
    return problems


def _check_kv(report_hosts: dict[str, HostView]) -> list[Problem]:
    problems = []
    for view in report_hosts.values():
        for unit in (view.snapshot or {}).get("units") or []:
            failed = (unit.get("metrics") or {}).get("kv_failed") or 0
            if failed:
                problems.append(
                    Problem(
                        "warning",
                        view.name,
                        unit["name"],
                        f"{unit['name']} counted {failed:.0f} failed KV transfers since it started",
                    )
                )
    return problems


def _check_weights_agree(topo: Topology, hosts: dict[str, HostView]) -> list[Problem]:
    markers = {
        name: ((view.snapshot or {}).get("weights") or {}).get("marker")
        for name, view in hosts.items()
        if topo.engines_on(name) and view.snapshot
    }
    found = {m for m in markers.values() if m}
    if len(found) <= 1:
        return []
    listed = ", ".join(f"{h} {m}" for h, m in sorted(markers.items()))
    return [Problem("degraded", None, "weights", f"hosts hold different weights: {listed}")]


# ------------------------------------------------------------------------------- the report


def host_problems(
    topo: Topology, view: HostView, now: float, weights_digest: str | None
) -> list[Problem]:
    if not view.reachable or view.snapshot is None:
        return [Problem("unknown", view.name, "ssh", view.error or "no answer")]
    snap = view.snapshot
    return [
        *_check_release(view, snap, now),
        *_check_units(view, snap),
        *_check_gpus(topo, view, snap),
        *_check_weights(topo, view, snap, weights_digest),
        *_check_caches(topo, view, snap),
        *_check_proxy(topo, view, snap, now),
    ]


def parse_answer(result: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A host's `hgxserve inspect` answer, or why there is none."""
    if not result.ok:
        return None, f"unreachable: {result.error}"
    if result.exit_status == 127:
        return None, "hgxserve is not installed on the host (run a deploy: the agent role)"
    if result.exit_status != 0:
        err = (result.stderr or result.stdout).strip()
        if "No such command" in err:
            return None, "the host's hgxserve has no `inspect` (older agent): re-run a deploy"
        return None, f"`hgxserve inspect` failed (exit {result.exit_status}): {err[-300:]}"
    try:
        data = json.loads(result.stdout)
    except ValueError:
        return None, f"`hgxserve inspect` printed no JSON: {result.stdout[:200]!r}"
    return (data, None) if isinstance(data, dict) else (None, "unexpected answer")


def build_report(  # noqa: PLR0913 - the status command's one call: three keyword-only options
    topo: Topology,
    topology_file: str,
    results: dict[str, Any],
    *,
    weights_digest: str | None = None,
    elapsed_s: float = 0.0,
    now: float | None = None,
) -> Report:
    """The report for `topo` from each host's `Result` of `hgxserve inspect`."""
    now = time.time() if now is None else now
    hosts: dict[str, HostView] = {}
    problems: list[Problem] = []
    for name, host in topo.hosts.items():
        plan = plan_release(topo, name)
        result = results.get(name)
        snapshot, error = parse_answer(result) if result is not None else (None, "not checked")
        view = HostView(
            name=name,
            address=host.address,
            reachable=bool(result and result.ok),
            error=error,
            elapsed_s=round(result.elapsed_s, 3) if result else 0.0,
            expected_release=plan.id,
            expected_units=plan.spec.unit_names,
            snapshot=snapshot,
        )
        hosts[name] = view
        problems += host_problems(topo, view, now, weights_digest)
    problems += _check_weights_agree(topo, hosts)
    problems += _check_kv(hosts)
    return Report(topo.name, topology_file, now, hosts, problems, elapsed_s)
