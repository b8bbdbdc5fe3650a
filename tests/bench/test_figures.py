"""Round figures from engine metrics, SLA verdicts, reports with plots, and run comparison."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hgxserve.base.errors import UsageError
from hgxserve.bench import metrics, report
from hgxserve.bench.run import _point, load_run, verdicts
from hgxserve.bench.scenario import LoadPoint, Scenario, Sla

T = metrics.Targets(
    "http://10.77.0.13:8000",
    (
        metrics.EngineTarget("prefill-0", "prefill", "vllm", "http://10.77.0.11:8100", 4),
        metrics.EngineTarget("decode-0", "decode", "vllm", "http://10.77.0.12:8200", 4),
        metrics.EngineTarget("combined-0", "combined", "sglang", "http://10.77.0.13:8300", 2),
    ),
    "tiny",
)
LAB = 'engine="0",model_name="tiny"'


def vllm_text(
    *, running=0, waiting=0, prompt=0, local=0, gen=0, done=0, e2e=(0, 0.0), ttft=(0, 0.0),
    xfer=(0, 0.0), failed=0,
) -> str:  # fmt: skip
    return "\n".join(
        [
            f"vllm:num_requests_running{{{LAB}}} {running}",
            f"vllm:num_requests_waiting{{{LAB}}} {waiting}",
            f"vllm:prompt_tokens_total{{{LAB}}} {prompt}",
            f'vllm:prompt_tokens_by_source_total{{{LAB},source="local_compute"}} {local}',
            f'vllm:prompt_tokens_by_source_total{{{LAB},source="external_kv_transfer"}} '
            f"{prompt - local}",
            f"vllm:generation_tokens_total{{{LAB}}} {gen}",
            f'vllm:request_success_total{{{LAB},finished_reason="length"}} {done}',
            f'vllm:request_success_total{{{LAB},finished_reason="stop"}} 0',
            f"vllm:e2e_request_latency_seconds_count{{{LAB}}} {e2e[0]}",
            f"vllm:e2e_request_latency_seconds_sum{{{LAB}}} {e2e[1]}",
            f"vllm:time_to_first_token_seconds_count{{{LAB}}} {ttft[0]}",
            f"vllm:time_to_first_token_seconds_sum{{{LAB}}} {ttft[1]}",
            f"vllm:nixl_xfer_time_seconds_count{{{LAB}}} {xfer[0]}",
            f"vllm:nixl_xfer_time_seconds_sum{{{LAB}}} {xfer[1]}",
            f"vllm:nixl_num_failed_transfers_total{{{LAB}}} {failed}",
        ]
    )


def sglang_text(*, running=0, queued=0, prompt=0, gen=0, done=0) -> str:  # type: ignore[no-untyped-def]
    lab = 'model_name="tiny"'
    return "\n".join(
        [
            f"sglang:num_running_reqs{{{lab}}} {running}",
            f"sglang:num_queue_reqs{{{lab}}} {queued}",
            f"sglang:prompt_tokens_total{{{lab}}} {prompt}",
            f"sglang:generation_tokens_total{{{lab}}} {gen}",
            f"sglang:num_requests_total{{{lab}}} {done}",
        ]
    )


def proxy_text(outstanding: int) -> str:
    return (
        f'hgxserve_proxy_outstanding_requests{{role="decode",instance="x"}} {outstanding}\n'
        'hgxserve_proxy_outstanding_requests{role="prefill",instance="y"} 0\n'
    )


def test_busy_names_every_non_idle_counter() -> None:
    snap = metrics.Snapshot(
        proxy_text(3),
        {
            "prefill-0": vllm_text(),
            "decode-0": vllm_text(running=2, waiting=1),
            "combined-0": sglang_text(queued=4),
        },
    )
    assert metrics.busy(T, snap) == {
        "proxy outstanding": 3,
        "decode-0 running": 2,
        "decode-0 waiting": 1,
        "combined-0 waiting": 4,
    }
    idle = metrics.Snapshot(
        proxy_text(0),
        {"prefill-0": vllm_text(), "decode-0": vllm_text(), "combined-0": sglang_text()},
    )
    assert metrics.busy(T, idle) == {}


def test_engine_figures_are_the_rounds_window() -> None:
    before = metrics.Snapshot(
        "",
        {
            "prefill-0": vllm_text(prompt=1000, local=1000, gen=10, done=10),
            "decode-0": vllm_text(
                prompt=1000,
                local=0,
                gen=500,
                done=10,
                e2e=(10, 5.0),
                ttft=(10, 1.0),
                xfer=(40, 0.4),
            ),  # fmt: skip
            "combined-0": sglang_text(prompt=50, gen=80, done=5),
        },
    )
    after = metrics.Snapshot(
        "",
        {
            # 16 requests of 128 prompt tokens in 2 s on 4 prefill GPUs
            "prefill-0": vllm_text(prompt=3048, local=3048, gen=26, done=26),
            # decode pulled every prompt (no local compute), 32 tokens each
            "decode-0": vllm_text(
                prompt=3048,
                local=0,
                gen=1012,
                done=26,
                e2e=(26, 9.96),
                ttft=(26, 1.8),
                xfer=(104, 1.04),
                failed=1,
            ),  # fmt: skip
            "combined-0": sglang_text(prompt=50, gen=80, done=5),
        },
    )
    fig = metrics.engine_figures(T, before, after, 2.0)
    assert fig["requests_finished"] == 16  # decode 16 + combined 0; prefill hand-offs not counted
    pre = fig["engines"]["prefill-0"]
    assert pre["prefill_tok_s_per_gpu"] == pytest.approx(2048 / 2 / 4)
    dec = fig["engines"]["decode-0"]
    assert dec["prompt_tokens_computed"] == 0
    # (e2e - ttft) / (tokens - requests): (4.96 - 0.8) / (512 - 16) s
    assert dec["tpot_ms_mean"] == pytest.approx((4.96 - 0.8) / 496 * 1000)
    assert dec["kv_transfers"] == 64 and dec["kv_transfer_failures"] == 1
    assert dec["kv_transfer_ms_mean"] == pytest.approx(10.0)
    assert fig["roles"]["prefill"]["prefill_tok_s_per_gpu"] == pytest.approx(256)
    assert fig["roles"]["decode"]["output_tok_s_per_gpu"] == pytest.approx(512 / 2 / 4)


def _point_result(ttft_p90_ms: float, tpot_p90_ms: float, errors: float = 0) -> dict:
    return {
        "client": {
            "ttft_ms_p90": ttft_p90_ms,
            "tpot_ms_p90": tpot_p90_ms,
            "requests": 16.0,
            "errors": errors,
            "output_token_throughput": 800.0,
        },
        "per_gpu": {"output_tok_s_per_gpu": 80.0},
        "roles": {"prefill": {"prefill_tok_s_per_gpu": 1500.0}},
    }


def test_verdicts_name_each_target_and_direction() -> None:
    scenario = Scenario(
        "long", 128, 32, concurrency=(4,),
        sla=Sla(ttft_s=3, tpot_ms=40, prefill_tok_s_per_gpu=2000, output_tok_s_per_gpu=50,
                error_rate=0.01),
    )  # fmt: skip
    got = {v["figure"]: v["ok"] for v in verdicts(scenario, _point_result(2840, 41, errors=1))}
    assert got == {
        "TTFT p90": True,  # 2.84 s, seed 000's production P90
        "TPOT p90": False,
        "prefill tok/s/GPU": False,
        "output tok/s/GPU": True,
        "error rate": False,
    }
    no_sla = Scenario("free", 128, 32, concurrency=(4,))
    assert verdicts(no_sla, _point_result(99999, 999)) == []


def _fake_run(run_id: str, ttft: float, tput: float, gpus: int = 10) -> dict:
    scenario = Scenario("long", 128, 32, concurrency=(1, 4), sla=Sla(ttft_s=0.05))
    points = []
    for c in (1, 4):
        rounds = [
            {
                "seed": seed,
                "client": {
                    "ttft_ms_p50": ttft * c + seed,
                    "ttft_ms_p90": ttft * c * 1.5 + seed,
                    "tpot_ms_p50": 10.0,
                    "tpot_ms_p90": 11.0,
                    "request_throughput": tput * c,
                    "output_token_throughput": tput * c * 32 + seed,
                    "requests": 16.0,
                    "errors": 0.0,
                },
                "engines": {"roles": {"decode": {"kv_transfers": 64.0}}},
            }
            for seed in (1, 2, 3)
        ]
        points.append(_point(scenario, LoadPoint(c), rounds, gpus))
    return {
        "schema_version": 1,
        "run_id": run_id,
        "topology": {
            "name": "demo-pd",
            "file": "t.yml",
            "digest": "ab" * 32,
            "gpus": gpus,
            "gpus_by_role": {"decode": 4},
        },  # fmt: skip
        "release_id": "r1",
        "engine_versions": {"decode-0": "vllm 0.0.0+simulated"},
        "proxy_url": "http://10.77.0.13:8000",
        "generator": {"name": "aiperf"},
        "scenarios": [scenario.to_dict()],
        "points": points,
        "verdicts": [],
        "passed": True,
    }


def test_point_is_the_median_over_seeds() -> None:
    run = _fake_run("a", ttft=20.0, tput=2.0)
    first = run["points"][0]
    assert first["client"]["ttft_ms_p50"] == 22.0  # median of 21, 22, 23
    assert first["per_gpu"]["output_tok_s_per_gpu"] == pytest.approx((64 + 2) / 10)
    assert [v["figure"] for v in first["verdicts"]] == ["TTFT p90"]


def test_report_writes_plots_and_the_misses(tmp_path: Path, matplotlib_extra: None) -> None:
    run = _fake_run("a", ttft=40.0, tput=2.0)
    run["passed"] = False
    run["verdicts"] = [
        {"scenario": "long", "point": "c4", **v}
        for v in run["points"][1]["verdicts"]
        if not v["ok"]
    ]
    path = report.write_report(tmp_path, run)
    text = path.read_text()
    for name in ("throughput.png", "ttft.png", "tpot.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"]({name})" in text
    assert "FAIL" in text
    assert "long c4: TTFT p90 0.242 s, SLA <= 0.05 s" in text


def test_compare_side_by_side_with_deltas(tmp_path: Path) -> None:
    a, b = _fake_run("a", ttft=20.0, tput=2.0), _fake_run("b", ttft=30.0, tput=2.0, gpus=8)
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    (b_dir / "run.json").write_text(json.dumps(b))
    text = report.compare([a, load_run(b_dir)])
    row = next(line for line in text.splitlines() if "c4" in line and "TTFT p50" in line)
    assert "82.00" in row and "122.00 (+48.8%)" in row
    gpu_row = next(line for line in text.splitlines() if "c1" in line and "tok/s/GPU" in line)
    assert "6.60" in gpu_row and "8.25 (+25.0%)" in gpu_row  # same throughput on fewer GPUs
    assert "a = demo-pd 10 GPUs" in text and "b = demo-pd 8 GPUs" in text


def test_load_run_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(UsageError, match="not a bench run"):
        load_run(tmp_path)
    bad = copy.deepcopy(tmp_path / "nothing")
    with pytest.raises(UsageError, match="not a bench run"):
        load_run(bad)


def test_compare_fails_on_a_regression_past_the_margin(tmp_path: Path) -> None:
    a, b = _fake_run("a", ttft=20.0, tput=2.0), _fake_run("b", ttft=30.0, tput=2.0)
    for run in (a, b):
        (tmp_path / run["run_id"]).mkdir()
        (tmp_path / run["run_id"] / "run.json").write_text(json.dumps(run))
    worse = report.regressions([a, b], 10)
    assert worse[0] == "b long c1: TTFT p50 ms 32.00 vs 22.00 (+45.5%, margin 10%)"
    assert all("TTFT" in line for line in worse)  # throughput and TPOT did not change
    assert report.regressions([a, b], 60) == [] and report.regressions([b, a], 10) == []
    hgxserve = Path(sys.executable).with_name("hgxserve")
    args = [str(hgxserve), "bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")]
    failed = subprocess.run([*args, "--max-regression", "10"], capture_output=True, text=True)
    assert failed.returncode == 1 and "regression: b long c4: TTFT p90" in failed.stderr
    passed = subprocess.run([*args, "--max-regression", "60"], capture_output=True, text=True)
    assert passed.returncode == 0 and "(+" in passed.stdout
    missing = subprocess.run([*args[:-1], str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2


def test_an_engine_on_loopback_only_needs_an_engine_url() -> None:
    from hgxserve.topology import load_topology

    topo = load_topology(Path(__file__).resolve().parents[2] / "topologies/demo/demo-pd.yml")
    with pytest.raises(UsageError, match=r"combined-0 listen\(s\) on loopback only .* ssh -N -L "
                       r"PORT:127\.0\.0\.1:8300 10\.77\.0\.13"):  # fmt: skip
        metrics.targets(topo)
    t = metrics.targets(topo, engine_urls={"combined-0": "http://127.0.0.1:18300/"})
    assert [e.url for e in t.engines] == [
        "http://10.77.0.11:8100", "http://10.77.0.12:8200", "http://127.0.0.1:18300",
    ]  # fmt: skip
    assert t.proxy_url == "http://10.77.0.13:8000"
    with pytest.raises(UsageError, match="names no engine"):
        metrics.targets(topo, engine_urls={"nope": "http://127.0.0.1:1"})
