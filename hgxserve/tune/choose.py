"""A candidate's verdict, figures and score from its bench run, and the best candidate.

- verdict: the bench run's own, read generically: `REFUSED` (a round refused), `INVALID` (a
  round the bench marks invalid, e.g. a P/D round whose KV did not move), `PASS` (every SLA met)
  or `FAIL`. Only `PASS` meets the SLA.
- score: output tokens/s per GPU (seed 003 §7: total / GPUs), per scenario the best load point,
  averaged over the scenarios.
- best: the highest score among `PASS` candidates; ties go to fewer GPUs, then to the name.

>>> best([{"name": "a", "verdict": "PASS", "score": 50.0, "gpus": 8},
...       {"name": "b", "verdict": "PASS", "score": 50.0, "gpus": 6},
...       {"name": "c", "verdict": "FAIL", "score": 90.0, "gpus": 4}])["name"]
'b'
"""

from __future__ import annotations

from typing import Any

PASS, FAIL, INVALID, REFUSED = "PASS", "FAIL", "INVALID", "REFUSED"


def _invalid(item: dict[str, Any]) -> bool:
    return item.get("valid") is False or str(item.get("verdict", "")).upper() == INVALID


def verdict(result: dict[str, Any]) -> str:
    if result.get("refused"):
        return REFUSED
    own = str(result.get("verdict") or "").upper()
    if own in (PASS, FAIL, INVALID):
        return own
    if _invalid(result) or any(_invalid(p) for p in result.get("points", [])):
        return INVALID
    return PASS if result.get("passed") else FAIL


def _statistic(scenario: dict[str, Any]) -> str:
    """The SLA statistic of a scenario: `p90`, or `mean` where the bench has one."""
    sla = scenario.get("sla") or {}
    statistic = sla.get("statistic")
    return str(statistic) if statistic else f"p{sla.get('percentile', 90)}"


def _at(client: dict[str, Any], figure: str, statistic: str) -> float | None:
    value = client.get(f"{figure}_{statistic}")
    if value is None:
        value = client.get(f"{figure}_p90")
    return float(value) if value is not None else None


def point_figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scenario and load point: tok/s/GPU, tok/s/user (1000 / TPOT), TTFT, TPOT at the SLA
    statistic, and whether the point met its SLA."""
    stats = {s["name"]: _statistic(s) for s in result.get("scenarios", [])}
    out = []
    for p in result.get("points", []):
        stat = stats.get(p["scenario"], "p90")
        client = p.get("client") or {}
        tpot = _at(client, "tpot_ms", stat)
        misses = [v["figure"] for v in p.get("verdicts", []) if not v.get("ok")]
        out.append(
            {
                "scenario": p["scenario"],
                "point": p["label"],
                "x": p.get("x"),
                "statistic": stat,
                "tok_s_per_gpu": (p.get("per_gpu") or {}).get("output_tok_s_per_gpu"),
                "tok_s_per_user": 1000.0 / tpot if tpot else None,
                "ttft_ms": _at(client, "ttft_ms", stat),
                "tpot_ms": tpot,
                "sla": INVALID
                if _invalid(p)
                else ("miss: " + ", ".join(misses) if misses else "met"),
            }
        )
    return out


def score(figures: list[dict[str, Any]]) -> float | None:
    """Mean over scenarios of each scenario's best output tok/s/GPU."""
    per_scenario: dict[str, float] = {}
    for f in figures:
        value = f["tok_s_per_gpu"]
        if value is not None:
            per_scenario[f["scenario"]] = max(value, per_scenario.get(f["scenario"], 0.0))
    if not per_scenario:
        return None
    return sum(per_scenario.values()) / len(per_scenario)


def best(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best candidate that met the SLA, or None."""
    passed = [r for r in records if r.get("verdict") == PASS and r.get("score") is not None]
    if not passed:
        return None
    return min(passed, key=lambda r: (-float(r["score"]), int(r.get("gpus") or 0), r["name"]))
