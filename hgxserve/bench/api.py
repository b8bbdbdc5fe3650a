"""The bench as a library: run scenarios against a deployed topology, get a verdict per scenario.

`hgxserve bench` is a thin command over `run_deployed`; other commands (a tuner, a release
gate) call `bench_deployed`, which never raises for a round that could not run: it reports it.

>>> outcome = bench_deployed(BenchRequest("topologies/demo/demo-pd.yml", Path("runs"),
...                                       inventory="inventory/lab.py"))  # doctest: +SKIP
>>> outcome.verdict, {s.name: s.verdict for s in outcome.scenarios}  # doctest: +SKIP
('PASS', {'pd-long': 'PASS', 'combined-short': 'PASS'})

Verdicts: PASS every SLA target met and every round valid; FAIL a target missed; INVALID a
P/D round whose KV did not all move (failed transfer, decode recompute, handoff without KV),
or a round that could not run clean (refused, generator failed, /metrics unreachable): such
numbers are never evidence for a topology.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hgxserve.base.errors import HgxserveError, UsageError
from hgxserve.bench.run import INVALID, point_verdict


@dataclass(frozen=True)
class BenchRequest:
    """What to bench and how to reach it (the options of `hgxserve bench run`)."""

    topology: str | Path
    out_root: Path
    scenarios: tuple[str, ...] = ()  # names; () = every scenario
    inventory: str | None = None  # read engines (and GPU telemetry) through the hosts
    from_host: str | None = None  # the load enters from this inventory host
    proxy_url: str | None = None
    engine_urls: dict[str, str] = field(default_factory=dict)
    tokenizer: str | None = None
    api_key: str | None = None
    metrics_key: str | None = None
    release_id: str | None = None
    round_timeout_s: float = 3600.0
    drain_timeout_s: float | None = None
    telemetry: bool = True  # sample GPU memory / power / utilisation during each round


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    verdict: str  # PASS | FAIL | INVALID
    points: list[dict[str, Any]]  # run.json's load points of this scenario (figures, verdicts)

    def best(self, key: str = "output_tok_s_per_gpu") -> float | None:
        """The highest per-GPU figure among this scenario's PASS points."""
        values = [
            p["per_gpu"].get(key)
            for p in self.points
            if point_verdict(p) == "PASS" and p["per_gpu"].get(key) is not None
        ]
        return max(values) if values else None


@dataclass(frozen=True)
class BenchOutcome:
    verdict: str  # PASS | FAIL | INVALID (the worst of the scenarios')
    scenarios: list[ScenarioResult]
    run_dir: Path | None
    result: dict[str, Any]  # run.json
    error: str | None = None  # why the run stopped (refused round, generator, /metrics)
    exit_code: int = 0  # what `hgxserve bench` exits with for this outcome


def exit_code_for(result: dict[str, Any]) -> int:
    """6 INVALID (no valid evidence), 1 an SLA missed, 0 PASS (README "Exit codes")."""
    from hgxserve.base.errors import ExitCode

    if result.get("verdict") == INVALID or result.get("refused"):
        return int(ExitCode.FAILED)
    return int(ExitCode.OK if result.get("passed") else ExitCode.FOUND)


def outcome_of(
    run_dir: Path | None, result: dict[str, Any], error: str | None = None
) -> BenchOutcome:
    from hgxserve.bench.run import FAIL, PASS, scenario_verdicts

    # runs kept before verdicts were recorded: judged from their points
    verdicts = result.get("scenario_verdicts") or (
        scenario_verdicts(result) if "scenarios" in result and "points" in result else {}
    )
    verdict = result.get("verdict") or (
        INVALID if result.get("refused") else PASS if result.get("passed") else FAIL
    )
    scenarios = [
        ScenarioResult(
            s["name"],
            verdicts.get(s["name"], INVALID),
            [p for p in result.get("points", []) if p["scenario"] == s["name"]],
        )
        for s in result.get("scenarios", [])
    ]
    return BenchOutcome(verdict, scenarios, run_dir, result, error, exit_code_for(result))


def run_deployed(req: BenchRequest, progress: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """Run the scenarios, write run.json, report.md and the plots; (run dir, run.json).
    Raises what the run raises (a refused round, the generator, an endpoint)."""
    from hgxserve.bench.reach import open_reach
    from hgxserve.bench.scenario import load_bench

    spec = load_bench(req.topology)
    spec.pick(list(req.scenarios))  # an unknown name stops here, before any SSH
    release_id, observed = req.release_id, dict[str, Any]()
    if req.inventory is not None:
        running, observed = running_releases(spec.topology, req.inventory)
        release_id = release_id or running
    reach = open_reach(
        spec.topology,
        inventory=req.inventory,
        from_host=req.from_host,
        proxy_url=req.proxy_url,
        engine_urls=req.engine_urls,
    )
    try:
        return _run_reached(req, spec, reach, (release_id, observed), progress)
    finally:
        reach.close()


def _run_reached(
    req: BenchRequest,
    spec: Any,
    reach: Any,
    release: tuple[str | None, dict[str, Any]],
    progress: Callable[[str], None],
) -> tuple[Path, dict[str, Any]]:
    from hgxserve.bench import report
    from hgxserve.bench.run import options_through, run_bench
    from hgxserve.bench.telemetry import Telemetry, open_telemetry

    release_id, observed = release
    for name, how in reach.via.items():
        progress(f"{name}: through an SSH tunnel to {how}")
    tele = open_telemetry(spec.topology, req.inventory) if req.telemetry else Telemetry(None, "off")
    opts = options_through(
        reach,
        req,
        req.out_root,
        release_id,
        drain_timeout_s=req.drain_timeout_s,
        engines_observed=observed,
        telemetry=tele.sampler,
        telemetry_why_none=tele.why_none,
    )
    try:
        run_dir, result = run_bench(spec, spec.pick(list(req.scenarios)), opts, progress)
    finally:
        tele.close()
    report.write_report(run_dir, result)
    return run_dir, result


def bench_deployed(req: BenchRequest, progress: Callable[[str], None] = print) -> BenchOutcome:
    """`run_deployed`, with a run that stopped reported as INVALID (its error and whatever
    run.json it kept) instead of raised. Bad requests (unknown scenario, scenario file errors)
    still raise UsageError / TopologyError: there is nothing to judge."""
    from hgxserve.bench.generator import GeneratorError
    from hgxserve.bench.metrics import MetricsError
    from hgxserve.bench.run import RoundRefused, load_run

    try:
        run_dir, result = run_deployed(req, progress)
    except (RoundRefused, GeneratorError, MetricsError) as exc:
        kept = _latest_run(req.out_root)
        result = load_run(kept) if kept is not None else {"scenarios": [], "points": []}
        result["verdict"] = INVALID
        return BenchOutcome(
            INVALID, outcome_of(kept, result).scenarios, kept, result, str(exc), int(exc.exit_code)
        )
    return outcome_of(run_dir, result)


def _latest_run(out_root: Path) -> Path | None:
    runs = sorted(p for p in out_root.glob("*/run.json")) if out_root.is_dir() else []
    return runs[-1].parent if runs else None


def running_releases(topo: Any, inventory: str) -> tuple[str, dict[str, Any]]:
    """`host=release id` of every host the topology uses, as `hgxserve release status` says,
    and host -> what each engine of its running release reported (start time, KV capacity)."""
    from hgxserve.base.paths import AGENT
    from hgxserve.remote.inventory import InventoryError, load_inventory
    from hgxserve.remote.ssh import Sessions

    names = topo.hosts_in_use()
    try:
        hosts = load_inventory(inventory).select(names)
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    parts = []
    observed: dict[str, Any] = {}
    with Sessions(hosts) as sessions:
        results = sessions.run_all(f"{AGENT} release status", 30)
    for name in names:
        result = results.get(name)
        running = "unknown"
        if result is not None and result.ok and result.exit_status == 0:
            try:
                state = json.loads(result.stdout)
                running = (state.get("pending") or {}).get("id") or state.get("current") or "none"
                if state.get("observed"):
                    observed[name] = state["observed"]
            except (ValueError, AttributeError):
                pass
        parts.append(f"{name}={running}")
    return " ".join(parts), observed


__all__ = [
    "BenchOutcome",
    "BenchRequest",
    "HgxserveError",
    "ScenarioResult",
    "bench_deployed",
    "exit_code_for",
    "outcome_of",
    "run_deployed",
]
