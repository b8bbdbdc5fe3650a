"""The wall time a tune will take, printed before it starts: per surviving candidate one cold start
and its bench rounds, plus the final release.

- cold start: the longest engine start the lab's running release measured (each engine's start
  time, which the release records: hgxserve.release.kvcap), else the candidate's longest
  `start_timeout_s` (the bound; its default 1800 s covers seed 003's measured ~12 min for vLLM
  TP8 with CUDA graphs and ~23 min for SGLang TP8 with a first JIT).
- bench: per round TUNE_ROUND_OVERHEAD_S plus (warm-up + requests) / concurrency requests in
  turn, each at most the SLA's TTFT + output x TPOT (TUNE_REQUEST_S without an SLA), or the
  round's duration_s.

>>> from hgxserve.bench.scenario import Scenario, Sla
>>> sla = Sla(ttft_s=1, tpot_ms=100)
>>> s = Scenario("x", 100, 10, concurrency=(2,), requests=4, warmup=2, sla=sla)
>>> bench_s([s]) == 20.0 + 3 * 2.0
True
"""

from __future__ import annotations

from typing import Any

from hgxserve.base.defaults import TUNE_REQUEST_S, TUNE_ROUND_OVERHEAD_S


def _request_s(scenario: Any) -> float:
    sla = scenario.sla
    if sla.ttft_s is not None and sla.tpot_ms is not None:
        return float(sla.ttft_s + scenario.output * sla.tpot_ms / 1000)
    return TUNE_REQUEST_S


def bench_s(scenarios: list[Any]) -> float:
    total = 0.0
    for s in scenarios:
        for point in s.load_points():
            if s.duration_s is not None:
                round_s = float(s.duration_s)
            else:
                requests = (s.requests_for(point) or 0) + s.warmup_for(point)
                round_s = -(-requests // point.concurrency) * _request_s(s)
            total += len(s.seeds) * (TUNE_ROUND_OVERHEAD_S + round_s)
    return total


def _measured(observed: dict[str, Any]) -> float | None:
    starts = [
        float(entry["start_s"])
        for units in observed.values()
        for entry in units.values()
        if isinstance(entry, dict) and entry.get("start_s") is not None
    ]
    return max(starts) if starts else None


def cold_start_s(topo: Any, observed: dict[str, Any]) -> tuple[float, str]:
    measured = _measured(observed)
    if measured is not None:
        return measured, "the longest engine start the lab's running release measured"
    bound = max(float(e.start_timeout_s) for e in topo.engines.values())
    return bound, "the engines' start_timeout_s (default 1800 s: seed 003 measured 12-23 min)"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def estimate(
    topos: list[Any], scenarios: list[Any], observed: dict[str, Any]
) -> tuple[float, list[str]]:
    """(seconds, lines to print) for the survivors and one final release."""
    per_bench = bench_s(scenarios)
    lines, total = [], 0.0
    for topo in topos:
        cold, source = cold_start_s(topo, observed)
        total += cold + per_bench
        lines.append(
            f"  {topo.name}: cold start {_minutes(cold)} ({source}) + bench {_minutes(per_bench)}"
        )
    if topos:
        cold, _ = cold_start_s(topos[0], observed)
        total += cold
        lines.append(f"  final release (the winner or the baseline): up to {_minutes(cold)}")
    head = (
        f"estimated wall time: {_minutes(total)} for {len(topos)} candidate(s) x (cold start + "
        f"{len(scenarios)} scenario(s))"
    )
    return total, [head, *lines]
