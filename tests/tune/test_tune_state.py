"""The tune's bookkeeping: the state file, what a resumed tune runs again, verdicts, scores, the
best candidate, the estimate and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hgxserve.base.errors import UsageError
from hgxserve.bench.scenario import Scenario, Sla
from hgxserve.tune import choose, estimate, report, state


def test_the_state_file_is_replaced_whole(tmp_path: Path) -> None:
    tune = state.new_state("t.tune.yaml", "d" * 64)
    state.add_candidate(tune, "a", "/x/a.yml", gpus=8)
    state.save(tmp_path, tune)
    assert json.loads((tmp_path / "state.json").read_text())["candidates"]["a"]["gpus"] == 8
    assert not (tmp_path / "state.json.tmp").exists()
    assert state.load(tmp_path, "d" * 64) == tune


def test_a_resumed_tune_runs_only_unfinished_candidates(tmp_path: Path) -> None:
    tune = state.new_state("t.tune.yaml", "d" * 64)
    for name, status in [
        ("done", "done"),
        ("failed", "failed"),
        ("pruned", "pruned"),
        ("deploying", "deploying"),
        ("benching", "benching"),
        ("pending", "pending"),
    ]:
        state.add_candidate(tune, name, f"/x/{name}.yml")["status"] = status
    state.save(tmp_path, tune)
    again = state.load(tmp_path, "d" * 64)
    # adding the candidates again (the resumed tune lists them) keeps their records
    done = state.add_candidate(again, "done", "/x/done.yml")
    assert done["status"] == "done"
    assert [r["name"] for r in state.to_run(again)] == ["deploying", "benching", "pending"]


def test_resume_refuses_another_spec_and_finds_the_unfinished_run(tmp_path: Path) -> None:
    old, new = tmp_path / "20260101T000000Z-t", tmp_path / "20260102T000000Z-t"
    for run_dir, final in ((old, None), (new, {"winner": "a"})):
        run_dir.mkdir()
        tune = state.new_state("t.tune.yaml", "d" * 64)
        tune["final"] = final
        state.save(run_dir, tune)
    with pytest.raises(UsageError, match="another SPEC"):
        state.load(old, "e" * 64)
    assert state.unfinished(tmp_path, "d" * 64) == old  # the newer one finished
    assert state.unfinished(tmp_path, "e" * 64) is None
    with pytest.raises(UsageError, match="not a tune run"):
        state.load(tmp_path)


def point(scenario: str, label: str, per_gpu: float, *, tpot: float = 10.0, ok: bool = True):
    return {
        "scenario": scenario,
        "label": label,
        "x": 4,
        "client": {"ttft_ms_p90": 200.0, "tpot_ms_p90": tpot, "tpot_ms_mean": tpot / 2},
        "per_gpu": {"output_tok_s_per_gpu": per_gpu},
        "verdicts": [{"figure": "TPOT p90", "ok": ok}],
    }


def run(points: list, *, passed: bool = True, **extra) -> dict:
    scenarios = [
        {"name": "a", "sla": {"percentile": 90}},
        {"name": "b", "sla": {"statistic": "mean"}},
    ]
    return {"points": points, "passed": passed, "scenarios": scenarios, **extra}


def test_verdicts_are_read_generically() -> None:
    assert choose.verdict(run([])) == "PASS"
    assert choose.verdict(run([], passed=False)) == "FAIL"
    assert choose.verdict(run([], refused="busy")) == "REFUSED"
    assert choose.verdict(run([], verdict="INVALID")) == "INVALID"
    invalid_point = {**point("a", "c1", 1.0), "valid": False}
    assert choose.verdict(run([invalid_point])) == "INVALID"


def test_figures_at_the_sla_statistic_and_the_score() -> None:
    figures = choose.point_figures(
        run([point("a", "c1", 10.0), point("a", "c4", 30.0, ok=False), point("b", "c1", 50.0)])
    )
    assert [(f["scenario"], f["point"], f["statistic"], f["sla"]) for f in figures] == [
        ("a", "c1", "p90", "met"),
        ("a", "c4", "p90", "miss: TPOT p90"),
        ("b", "c1", "mean", "met"),
    ]
    assert figures[0]["tpot_ms"] == 10.0 and figures[0]["tok_s_per_user"] == 100.0
    assert figures[2]["tpot_ms"] == 5.0  # the mean, where the scenario's statistic is mean
    assert choose.score(figures) == (30.0 + 50.0) / 2  # each scenario's best point, averaged
    assert choose.score([]) is None


def test_the_best_meets_the_sla_then_has_more_tok_s_per_gpu_then_fewer_gpus() -> None:
    def rec(name: str, verdict: str, score: float | None, gpus: int) -> dict:
        return {"name": name, "verdict": verdict, "score": score, "gpus": gpus}

    assert choose.best([rec("a", "FAIL", 99, 1), rec("b", "INVALID", 99, 1)]) is None
    assert choose.best([rec("a", "PASS", 10, 8), rec("b", "PASS", 20, 8)])["name"] == "b"
    assert choose.best([rec("a", "PASS", 20, 8), rec("b", "PASS", 20, 6)])["name"] == "b"
    assert choose.best([rec("a", "PASS", None, 8), rec("b", "FAILED", None, 6)]) is None


def test_the_estimate_uses_a_measured_start_when_the_lab_has_one() -> None:
    class Engine:
        start_timeout_s = 1800

    class Topo:
        name = "t"
        engines = {"e": Engine()}

    scenario = Scenario(
        "s", 100, 10, concurrency=(2,), requests=4, warmup=2, sla=Sla(ttft_s=1, tpot_ms=100)
    )
    total, lines = estimate.estimate([Topo(), Topo()], [scenario], {})
    bench = estimate.bench_s([scenario])
    assert bench == 20.0 + 3 * 2.0
    assert total == 3 * 1800 + 2 * bench
    assert "start_timeout_s" in lines[1]
    observed = {"hgx-a": {"hgxserve-engine-e.service": {"start_s": 700.5}}}
    total, lines = estimate.estimate([Topo()], [scenario], observed)
    assert total == 2 * 700.5 + bench and "measured" in lines[1]


def test_the_report_lists_candidates_and_the_pruned_with_reasons(
    tmp_path: Path, matplotlib_extra: None
) -> None:
    tune = state.new_state("t.tune.yaml", "d" * 64)
    ran = state.add_candidate(tune, "a", "/x/a.yml", gpus=8)
    figures = choose.point_figures(run([point("a", "c4", 42.0)]))
    ran.update(status="done", verdict="PASS", figures=figures, score=42.0, attempts=1)
    pruned = state.add_candidate(tune, "b", "/x/b.yml")
    pruned.update(status="pruned", reasons=["b.yml:3:1: $.engines: too big", "fit estimate: x"])
    tune["final"] = {"winner": "a", "left_on": "/x/a.yml", "why": "best", "deployed": True}
    tune["scenarios"] = [Scenario("a", 128, 64, concurrency=(4,), sla=Sla(tpot_ms=20)).to_dict()]
    path = report.write(tmp_path, tune)
    assert "- scenarios: a 128/64 SLA TPOT p90 <= 20 ms" in path.read_text()
    assert (tmp_path / "tune.png").stat().st_size > 0  # matplotlib_extra: the [bench] extra
    text = path.read_text()
    assert "| a | 8 | a | c4 | 42.0 | 100.0 | 200.0 | 10.0 | p90 | met | PASS |" in text
    assert "  - b.yml:3:1: $.engines: too big" in text and "  - fit estimate: x" in text
    assert json.loads((tmp_path / "report.json").read_text())["final"]["winner"] == "a"


def test_where_the_lab_is_left(tmp_path: Path) -> None:
    from hgxserve.tune.loop import final_target
    from hgxserve.tune.spec import TuneSpec

    base = tmp_path / "base.yml"
    spec = TuneSpec(file="t", digest="d", base=base)
    tune = state.new_state("t", "d")
    a = state.add_candidate(tune, "a", "/x/a.yml", gpus=8)
    b = state.add_candidate(tune, "b", "/x/b.yml", gpus=4)
    state.add_candidate(tune, "c", "/x/c.yml")["status"] = "pruned"
    # every candidate pruned or not run: the lab is not touched
    assert final_target(spec, tune) == {
        "winner": None, "left_on": None, "why": "nothing was deployed", "deploy": False
    }  # fmt: skip
    a.update(attempts=1, verdict="PASS", score=10.0)
    b.update(attempts=1, verdict="FAIL", score=50.0)
    tune["deployed"] = "/x/b.yml"
    best = final_target(spec, tune)
    assert best == {"winner": "a", "left_on": "/x/a.yml", "why": "best candidate a", "deploy": True}
    tune["deployed"] = "/x/a.yml"  # the last deploy left it running: no second release
    assert final_target(spec, tune)["deploy"] is False
    stay = final_target(TuneSpec(file="t", digest="d", base=base, leave="baseline"), tune)
    assert stay["left_on"] == str(base.resolve()) and stay["why"] == "baseline (leave: baseline)"
    assert stay["winner"] == "a" and stay["deploy"] is True
    a["verdict"] = "FAIL"
    none = final_target(spec, tune)
    assert none["winner"] is None and none["why"] == "baseline (no candidate met the SLA)"
