"""Bench fidelity without a lab: the SLA statistic, KV validity of P/D rounds, speculative
acceptance, GPU telemetry from real-format output, datasets, the per-scenario figures and the
seeds' scenarios shipped with the seed topologies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hgxserve.bench import dataset, metrics, report, telemetry
from hgxserve.bench.api import exit_code_for, outcome_of
from hgxserve.bench.run import _finish, _point, verdicts
from hgxserve.bench.scenario import Dataset, LoadPoint, Scenario, Sla, load_bench
from hgxserve.topology import TopologyError

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "testbed/fakes"
LAB = 'engine="0",model_name="tiny"'


# ------------------------------------------------------------------ the SLA statistic


def _client(ttft_avg: float, ttft_p90: float, tpot_avg: float, tpot_p90: float) -> dict:
    return {
        "client": {"ttft_ms_avg": ttft_avg, "ttft_ms_p90": ttft_p90, "tpot_ms_avg": tpot_avg,
                   "tpot_ms_p90": tpot_p90, "requests": 10.0, "errors": 0.0},
        "per_gpu": {}, "roles": {},
    }  # fmt: skip


def test_the_mean_statistic_judges_the_mean_not_the_tail() -> None:
    # seed 000 §6: mean TPOT ~34 ms under 40, a tail above it
    point = _client(ttft_avg=2500, ttft_p90=3400, tpot_avg=34, tpot_p90=45)
    mean = Scenario(
        "s", 4096, 256, concurrency=(8,), sla=Sla(statistic="mean", ttft_s=3, tpot_ms=40)
    )
    assert {v["figure"]: v["ok"] for v in verdicts(mean, point)} == {
        "TTFT mean": True,
        "TPOT mean": True,
    }
    tail = Scenario("s", 4096, 256, concurrency=(8,), sla=Sla(ttft_s=3, tpot_ms=40))
    assert {v["figure"]: (v["ok"], v["value"]) for v in verdicts(tail, point)} == {
        "TTFT p90": (False, 3.4),
        "TPOT p90": (False, 45),
    }
    mixed = Sla(statistic="mean", tpot_statistic="p90", ttft_s=3, tpot_ms=40)
    scenario = Scenario("s", 4096, 256, concurrency=(8,), sla=mixed)
    assert [v["figure"] for v in verdicts(scenario, point)] == ["TTFT mean", "TPOT p90"]


def _bench_topology(tmp_path: Path, bench: str) -> Path:
    path = tmp_path / "t.yml"
    path.write_text((REPO / "topologies/demo/demo-pd.yml").read_text())
    (tmp_path / "t.bench.yaml").write_text(bench)
    return path


def test_percentile_is_still_accepted_and_statistic_replaces_it(tmp_path: Path) -> None:
    path = _bench_topology(
        tmp_path,
        "bench:\n  scenarios:\n"
        "    - {name: a, input: 8, output: 8, concurrency: [1], sla: {percentile: 95, ttft_s: 1}}\n"
        "    - {name: b, input: 8, output: 8, concurrency: [1], sla: {statistic: mean}}\n"
        "    - {name: c, input: 8, output: 8, concurrency: [1]}\n",
    )
    a, b, c = load_bench(path).scenarios
    assert a.sla.statistic_for("ttft") == "p95" and b.sla.statistic_for("tpot") == "mean"
    assert c.sla.statistic_for("ttft") == "p90"
    assert a.to_dict()["sla"]["ttft_statistic"] == "p95"


def test_statistic_errors_have_positions(tmp_path: Path) -> None:
    path = _bench_topology(
        tmp_path,
        "bench:\n"
        "  scenarios:\n"
        "    - name: a\n"
        "      input: 8\n"
        "      output: 8\n"
        "      concurrency: [1]\n"
        "      sla: {percentile: 95, statistic: mean}\n"
        "    - name: b\n"
        "      input: 8\n"
        "      output: 8\n"
        "      concurrency: [1]\n"
        "      sla: {statistic: p42}\n",
    )
    with pytest.raises(TopologyError) as exc:
        load_bench(path)
    texts = [p.text() for p in exc.value.problems]
    bench = tmp_path / "t.bench.yaml"
    assert any(t.startswith(f"{bench}:12:") and "$.bench.scenarios[1].sla.statistic" in t
               for t in texts), texts  # fmt: skip
    fixed = bench.read_text().replace("statistic: p42", "statistic: p99")
    bench.write_text(fixed)
    with pytest.raises(TopologyError) as exc:
        load_bench(path)
    (text,) = [p.text() for p in exc.value.problems]
    assert text.startswith(f"{bench}:7:") and "$.bench.scenarios[0].sla.statistic" in text
    assert "give statistic or percentile, not both" in text


# ------------------------------------------------------------------ P/D validity


def vllm(*, prompt=0, local=0, done=0, failed=0, drafts=0, draft=0, accepted=0, expired=0) -> str:  # type: ignore[no-untyped-def]
    return "\n".join(
        [
            f"vllm:num_requests_running{{{LAB}}} 0",
            f"vllm:nixl_num_kv_expired_reqs_total{{{LAB}}} {expired}",
            f"vllm:prompt_tokens_total{{{LAB}}} {prompt}",
            f'vllm:prompt_tokens_by_source_total{{{LAB},source="local_compute"}} {local}',
            f'vllm:request_success_total{{{LAB},finished_reason="length"}} {done}',
            f"vllm:nixl_num_failed_transfers_total{{{LAB}}} {failed}",
            f"vllm:spec_decode_num_drafts_total{{{LAB}}} {drafts}",
            f"vllm:spec_decode_num_draft_tokens_total{{{LAB}}} {draft}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{LAB}}} {accepted}",
        ]
    )


def handoffs(ok: int = 0, none: int = 0, failed: int = 0) -> str:
    name = "hgxserve_proxy_kv_handoffs_total"
    return (
        f'{name}{{result="ok"}} {ok}\n{name}{{result="none"}} {none}\n'
        f'{name}{{result="failed"}} {failed}\n'
    )


PD = metrics.Targets(
    "http://p",
    (
        metrics.EngineTarget("prefill-0", "prefill", "vllm", "http://a", 4),
        metrics.EngineTarget("decode-0", "decode", "vllm", "http://b", 4),
    ),
)


def _snap(proxy: str, prefill: str, decode: str) -> metrics.Snapshot:
    return metrics.Snapshot(proxy, {"prefill-0": prefill, "decode-0": decode})


def test_a_clean_pd_round_is_valid() -> None:
    before = _snap(handoffs(), vllm(), vllm())
    # 16 requests of 128 tokens: the decode computed one token of each itself
    after = _snap(handoffs(ok=16), vllm(prompt=2048, local=2048, done=16),
                  vllm(prompt=2048, local=16, done=16))  # fmt: skip
    kv = metrics.kv_validity(PD, before, after)
    assert kv["valid"] is True and kv["why"] == [] and kv["handoffs"]["ok"] == 16


@pytest.mark.parametrize(
    ("after", "why"),
    [
        (_snap(handoffs(ok=16), vllm(), vllm(prompt=2048, local=16, done=16, failed=3)),
         "3 failed KV transfer(s)"),
        (_snap(handoffs(ok=16), vllm(), vllm(prompt=2048, local=16 + 128, done=16)),
         "128 prompt tokens recomputed by the decode"),
        (_snap(handoffs(ok=16), vllm(expired=2), vllm(prompt=2048, local=16, done=16)),
         "2 request(s) whose KV expired"),
        (_snap(handoffs(ok=15, none=1), vllm(), vllm(prompt=2048, local=16, done=16)),
         "1 handoff(s) without KV"),
        (_snap(handoffs(ok=15, failed=1), vllm(), vllm(prompt=2048, local=16, done=16)),
         "1 handoff(s) failed at the proxy"),
    ],
)  # fmt: skip
def test_any_failed_or_recomputed_transfer_makes_the_round_invalid(
    after: metrics.Snapshot, why: str
) -> None:
    kv = metrics.kv_validity(PD, _snap(handoffs(), vllm(), vllm()), after)
    assert kv["valid"] is False and any(why in w for w in kv["why"]), kv  # type: ignore[attr-defined]


def test_pd_local_routing_is_policy_not_recompute() -> None:
    # the KV-aware proxy sent 4 requests to the decode alone (few uncached tokens): the decode's
    # local prompt tokens are then expected; a failed transfer still makes the round INVALID
    local = '\nhgxserve_proxy_route_decisions_total{route="pd-local",reason="cached"} 4\n'
    before = _snap(handoffs(), vllm(), vllm())
    after = _snap(handoffs(ok=12), vllm(), vllm(prompt=2048, local=12 + 512, done=16))
    after_local = metrics.Snapshot(after.proxy + local, after.engines)
    assert metrics.kv_validity(PD, before, after)["valid"] is False
    kv = metrics.kv_validity(PD, before, after_local)
    assert kv["valid"] is True and kv["pd_local_requests"] == 4, kv
    assert kv["decode_recomputed_tokens"] == 12 + 512 - 16  # reported, not a reason
    failed = _snap(handoffs(ok=12), vllm(), vllm(prompt=2048, local=524, done=16, failed=1))
    kv = metrics.kv_validity(PD, before, metrics.Snapshot(failed.proxy + local, failed.engines))
    assert kv["valid"] is False and kv["failed_transfers"] == 1


def test_sglang_transfer_and_bootstrap_failures_count() -> None:
    t = metrics.Targets(
        "http://p",
        (
            metrics.EngineTarget("prefill-0", "prefill", "sglang", "http://a", 8),
            metrics.EngineTarget("decode-0", "decode", "sglang", "http://b", 8),
        ),
    )
    lab = 'model_name="m"'

    def text(transfer: int, bootstrap: int) -> str:
        return (
            f"sglang:num_transfer_failed_reqs_total{{{lab}}} {transfer}\n"
            f"sglang:num_bootstrap_failed_reqs_total{{{lab}}} {bootstrap}\n"
        )

    kv = metrics.kv_validity(
        t, _snap(handoffs(), text(0, 0), text(0, 0)), _snap(handoffs(ok=8), text(0, 0), text(2, 1))
    )
    assert kv["valid"] is False and kv["failed_transfers"] == 3
    combined = metrics.Targets("http://p", (metrics.EngineTarget("c", "combined", "vllm", "u", 1),))
    idle = metrics.Snapshot("", {"c": vllm()})
    assert metrics.kv_validity(combined, idle, metrics.Snapshot("", {"c": vllm(local=99)}))["valid"]


def test_an_invalid_point_makes_the_run_invalid_whatever_its_sla() -> None:
    scenario = Scenario("pd", 128, 8, concurrency=(2,), sla=Sla(ttft_s=30))
    good = {"seed": 1, "label": "pd-c2-s1", "valid": True, "client": {"ttft_ms_p90": 10.0},
            "engines": {"roles": {}}, "kv": {"failed_transfers": 0}}  # fmt: skip
    bad = {**good, "seed": 2, "label": "pd-c2-s2", "valid": False,
           "kv": {"failed_transfers": 4, "why": ["4 failed KV transfer(s)"]}}  # fmt: skip
    point = _point(scenario, LoadPoint(2), [good, bad], 8)
    assert point["verdict"] == "INVALID" and point["kv"]["failed_transfers"] == 4
    assert point["invalid_why"] == ["pd-c2-s2: 4 failed KV transfer(s)"]
    result = {"scenarios": [scenario.to_dict()], "points": [point]}
    _finish(result)
    assert result["verdict"] == "INVALID" and result["passed"] is False
    assert result["verdicts"] == [] and exit_code_for(result) == 6
    outcome = outcome_of(None, result)
    assert [(s.name, s.verdict) for s in outcome.scenarios] == [("pd", "INVALID")]
    assert outcome.exit_code == 6


def test_speculative_acceptance_from_engine_counters() -> None:
    before = vllm(drafts=100, draft=300, accepted=150)
    after = vllm(drafts=300, draft=900, accepted=510)  # 360 of 600 drafted tokens accepted
    fig = metrics.spec_figures("vllm", before, after)
    assert fig["spec_acceptance_rate"] == pytest.approx(0.6)
    assert fig["spec_accept_length"] == pytest.approx(1 + 360 / 200)
    assert metrics.spec_figures("vllm", "", "vllm:num_requests_running 0") == {
        "spec_acceptance_rate": None,
        "spec_accept_length": None,
    }
    sgl = 'sglang:spec_accept_length{model_name="m"} 2.71\n'
    assert metrics.spec_figures("sglang", "", sgl)["spec_accept_length"] == 2.71


# ------------------------------------------------------------------ GPU telemetry


def _fake_smi(args: list[str], gpu_dir: Path) -> str:
    """The test hosts' nvidia-smi (real captured 8xH200 output) run here."""
    env = {**os.environ, "HGXSERVE_SIM_GPU_DIR": str(gpu_dir), "HGXSERVE_FAKE_GPU": "h200"}
    return subprocess.run(
        [sys.executable, str(FAKES / "nvidia_smi.py"), *args],
        check=True, capture_output=True, text=True, env=env,
    ).stdout  # fmt: skip


def _engine_memory(gpu_dir: Path, gpus: range, mib: int) -> None:
    gpu_dir.mkdir(exist_ok=True)
    for gpu in gpus:
        (gpu_dir / f"{gpu}.json").write_text(
            json.dumps({"pid": os.getpid(), "name": "VLLM::EngineCore", "used_mib": mib})
        )


def test_nvidia_smi_query_in_its_real_format(tmp_path: Path) -> None:
    # the real header layout (fixtures/real/h200_query-gpu.txt): "name, memory.total [MiB]"
    real = (FAKES / "fixtures/h200_query-gpu.txt").read_text().splitlines()[1:3]
    assert real[0].startswith("name, memory.total [MiB]") and real[1].endswith("16")
    _engine_memory(tmp_path / "gpus", range(4), 130215)
    text = _fake_smi(["--query-gpu=index,memory.used,power.draw,utilization.gpu",
                      "--format=csv"], tmp_path / "gpus")  # fmt: skip
    assert text.splitlines()[0] == "index, memory.used [MiB], power.draw [W], utilization.gpu [%]"
    samples = telemetry.parse_nvidia_smi(text, "hgx-a")
    assert len(samples) == 8
    assert samples[0].memory_used_mib == 130215 and samples[7].memory_used_mib == 0
    assert samples[0].util_pct == 40 and samples[7].util_pct == 0
    assert all(s.power_w and 50 < s.power_w <= 700 for s in samples)
    assert telemetry.parse_nvidia_smi("index, power.draw [W]\n0, [N/A]\n", "h")[0].power_w is None


def test_dcgm_exporter_metrics_in_its_real_format(tmp_path: Path) -> None:
    _engine_memory(tmp_path / "gpus", range(2), 80000)
    counters = REPO / "tests/golden/monitoring/demo-pd-monitored/dcgm-exporter/dcgm-counters.csv"
    env = {
        **os.environ,
        "HGXSERVE_SIM_GPU_DIR": str(tmp_path / "gpus"),
        "HGXSERVE_FAKE_GPU": "h200",
    }
    code = (
        f"import sys; sys.path.insert(0, {str(FAKES)!r}); import dcgm_exporter; "
        f"print(dcgm_exporter.render({str(counters)!r}))"
    )
    text = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, env=env).stdout  # fmt: skip
    assert 'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-' in text
    samples = telemetry.parse_dcgm(text, "hgx-b")
    assert [s.gpu for s in samples] == [str(i) for i in range(8)]
    assert samples[0].memory_used_mib == 80000 and samples[0].util_pct == 40
    assert samples[5].memory_used_mib == 0 and samples[5].power_w is not None


def test_the_sampler_summarises_min_mean_max_per_host() -> None:
    readings = iter([[100.0, 300.0], [200.0, 400.0]] + [[200.0, 400.0]] * 100)

    def probe() -> list[telemetry.GpuSample]:
        power = next(readings)
        return [telemetry.GpuSample("hgx-a", str(i), 1000.0, p, 50.0) for i, p in enumerate(power)]

    sampler = telemetry.Sampler(probe, "test", interval_s=0.05)
    sampler.start()
    time.sleep(0.08)  # two samples at least
    summary = sampler.stop()
    host = summary["hosts"]["hgx-a"]
    assert host["gpus"] == 2 and host["samples"] >= 4
    assert host["power_w"]["min"] == 100 and host["power_w"]["max"] == 400
    assert 100 < host["power_w"]["mean"] < 400 and host["util_pct"]["mean"] == 50

    def broken() -> list[telemetry.GpuSample]:
        raise RuntimeError("hgx-a: nvidia-smi failed: NVML not loaded")

    bad = telemetry.Sampler(broken, "nvidia-smi", interval_s=0.05)
    bad.start()
    time.sleep(0.02)
    assert bad.stop()["errors"][0].endswith("NVML not loaded")


# ------------------------------------------------------------------ datasets


def test_prompts_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a", "output_length": 4}\n\n{"prompt": "b"}\n{"text": 3}\n')
    with pytest.raises(dataset.DatasetError, match=rf"{path}:4: want a non-empty string"):
        dataset.load_dataset(Dataset(path, "prompts"), None)
    path.write_text('{"text": "a", "output_length": 4}\n{"text": "b"\n')
    with pytest.raises(dataset.DatasetError, match=rf"{path}:2:\d+: not JSON"):
        dataset.load_dataset(Dataset(path, "prompts"), None)
    path.write_text('{"text": "a", "output_length": 4}\n{"prompt": "b"}\n')
    with pytest.raises(dataset.DatasetError, match="no output_length"):
        dataset.load_dataset(Dataset(path, "prompts"), None)
    entries, _ = dataset.load_dataset(Dataset(path, "prompts", limit=5), 16)
    assert entries == [{"text": "a", "output_length": 16}, {"text": "b", "output_length": 16}]


def test_sharegpt_takes_the_first_exchange_and_skips_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"id": "1", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello there!"}]},
        {"id": "2", "conversations": [{"from": "gpt", "value": "alone"}]},
        {"id": "3", "conversations": []},
        {"id": "4", "conversations": [{"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a" * 400}]},
    ], indent=1))  # fmt: skip
    entries, skipped = dataset.load_dataset(Dataset(path, "sharegpt"), None)
    assert entries == [{"text": "hi", "output_length": 3}, {"text": "q", "output_length": 100}]
    assert skipped == 2
    assert dataset.load_dataset(Dataset(path, "sharegpt", limit=1), 7)[0] == [
        {"text": "hi", "output_length": 7}
    ]
    path.write_text('[\n {"conversations": [}\n]')
    with pytest.raises(dataset.DatasetError, match=rf"{path}:2:\d+: not JSON"):
        dataset.load_dataset(Dataset(path, "sharegpt"), None)


def test_dataset_reads_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text('{"text": "a", "output_length": 1}\n' * 50)
    monkeypatch.setattr(dataset, "BENCH_DATASET_MAX_BYTES", 100)
    with pytest.raises(dataset.DatasetError, match="more than the 100 a dataset may have"):
        dataset.load_dataset(Dataset(path, "prompts"), None)
    monkeypatch.setattr(dataset, "BENCH_DATASET_MAX_BYTES", 1 << 20)
    monkeypatch.setattr(dataset, "BENCH_DATASET_MAX_LINES", 10)
    with pytest.raises(dataset.DatasetError, match="more than 10 lines"):
        dataset.load_dataset(Dataset(path, "prompts"), None)
    with pytest.raises(dataset.DatasetError, match="cannot read the dataset"):
        dataset.load_dataset(Dataset(tmp_path / "missing.jsonl", "prompts"), None)


def bench_problems(topology: Path, bench_yaml: str) -> str:
    """The problems `load_bench` finds (it must find some) once the topology's bench file
    reads `bench_yaml`, one text a line."""
    (topology.parent / "t.bench.yaml").write_text(bench_yaml)
    with pytest.raises(TopologyError) as exc:
        load_bench(topology)
    return "\n".join(p.text() for p in exc.value.problems)


def test_a_dataset_scenario_is_relative_to_its_file_and_takes_no_input(tmp_path: Path) -> None:
    path = _bench_topology(
        tmp_path,
        "bench:\n  scenarios:\n"
        "    - {name: d, dataset: {path: data/p.jsonl, format: prompts}, concurrency: [1]}\n",
    )
    (d,) = load_bench(path).scenarios
    assert d.dataset == Dataset(tmp_path / "data/p.jsonl", "prompts") and d.input is None
    texts = bench_problems(
        path,
        "bench:\n  scenarios:\n"
        "    - {name: d, input: 5, dataset: {path: p.jsonl, format: csv}, concurrency: [1]}\n"
        "    - {name: e, output: 5, concurrency: [1]}\n",
    )
    assert "$.bench.scenarios[0].dataset.format" in texts
    texts = bench_problems(
        path,
        "bench:\n  scenarios:\n"
        "    - {name: d, input: 5, dataset: {path: p.jsonl, format: prompts}, concurrency: [1]}\n"
        "    - {name: e, output: 5, concurrency: [1]}\n",
    )
    assert "$.bench.scenarios[0].input: a dataset brings its own prompts" in texts
    assert "$.bench.scenarios[1]: 'input' is a required property" in texts


# ------------------------------------------------------------------ figures


def _run(run_id: str, per_user: list[float], per_gpu: list[float], invalid: int = -1) -> dict:
    scenario = Scenario("long", 128, 32, concurrency=(1, 4, 16),
                        sla=Sla(statistic="mean", ttft_s=1, tpot_ms=50))  # fmt: skip
    points = []
    for i, c in enumerate((1, 4, 16)):
        rnd = {
            "seed": 1, "label": f"long-c{c}-s1", "valid": i != invalid,
            "kv": {"failed_transfers": 0 if i != invalid else 2,
                   "why": ["2 failed KV transfer(s)"]},
            "client": {"ttft_ms_avg": 100.0 * c, "tpot_ms_avg": 1000 / per_user[i],
                       "output_tok_s_per_user": per_user[i],
                       "output_token_throughput": per_gpu[i] * 8, "requests": 16.0,
                       "errors": 0.0},
            "engines": {"roles": {}},
        }  # fmt: skip
        points.append(_point(scenario, LoadPoint(c), [rnd], 8))
    result = {
        "schema_version": 1, "run_id": run_id,
        "topology": {"name": run_id, "file": "t.yml", "digest": "ab" * 32, "gpus": 8,
                     "gpus_by_role": {"combined": 8}},
        "release_id": "r", "engine_versions": {}, "proxy_url": "http://p",
        "generator": {"name": "aiperf"}, "scenarios": [scenario.to_dict()], "points": points,
        "rounds": [],
    }  # fmt: skip
    _finish(result)
    return result


def test_report_table_and_per_scenario_figures_with_their_data(
    tmp_path: Path, matplotlib_extra: None
) -> None:
    # per user 40 / 25 / 10 tok/s, per GPU 5 / 12 / 20: all on the front; TPOT 25/40/100 ms
    run = _run("tp8", [40, 25, 10], [5, 12, 20])
    path = report.write_report(tmp_path, run)
    text = path.read_text()
    assert "| long | c4 | PASS | 12.0 | 25.0 | 400.0 (mean) | 40.0 (mean) |" in text
    assert "| long | c16 | FAIL |" in text  # TTFT mean 1.6 s, TPOT mean 100 ms
    for name in ("pareto-long.png", "latency-long.png", "throughput.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in text
    data = json.loads((tmp_path / "plots.json").read_text())
    pareto = data["pareto-long.png"]
    assert pareto["front"] == [[10, 20], [25, 12], [40, 5]]
    assert pareto["sla_region"] == {"x_min": 20.0, "y_min": None}  # TPOT <= 50 ms: >= 20 tok/s
    assert [p["verdict"] for p in pareto["series"][0]["points"]] == ["PASS", "PASS", "FAIL"]
    latency = data["latency-long.png"]
    assert latency["sla"] == {"ttft_ms": 1000, "tpot_ms": 50}
    assert latency["series"][0]["ttft_ms"] == [100, 400, 1600]
    assert latency["ttft_statistic"] == "mean" and latency["x_axis"] == "concurrency"


def test_compare_draws_every_run_and_one_front(tmp_path: Path, matplotlib_extra: None) -> None:
    a = _run("tp8", [40, 25, 10], [5, 12, 20])
    b = _run("1p1d", [45, 30, 12], [4, 14, 30], invalid=2)  # its best point is INVALID
    for run in (a, b):
        (tmp_path / run["run_id"]).mkdir()
        (tmp_path / run["run_id"] / "run.json").write_text(json.dumps(run))
    plots = tmp_path / "plots"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("hgxserve")), "bench", "compare",
         str(tmp_path / "tp8"), str(tmp_path / "1p1d"), "--plots", str(plots)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"plot: {plots / 'pareto-long.png'}" in proc.stdout
    assert (plots / "latency-long.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((plots / "plots.json").read_text())
    pareto = data["pareto-long.png"]
    assert [s["run"] for s in pareto["series"]] == ["tp8 (tp8)", "1p1d (1p1d)"]
    # (12, 30) is INVALID: not on the front, so tp8's (10, 20) is
    assert pareto["front"] == [[10, 20], [30, 14], [40, 5], [45, 4]]
    assert pareto["series"][1]["points"][2]["verdict"] == "INVALID"
    verdict_rows = [line for line in proc.stdout.splitlines() if "| verdict" in line]
    cells = [[c.strip() for c in row.split("|")[1:]] for row in verdict_rows]
    assert cells == [["c1", "verdict", "PASS", "PASS"], ["c4", "verdict", "PASS", "PASS"],
                     ["c16", "verdict", "FAIL", "INVALID"]]  # fmt: skip


# ------------------------------------------------------------------ the seeds' scenarios


SEED_SCENARIOS = {
    "topologies/h200-dsv32-tp8.yml": {"prefill-4096-1"},  # seed 001 §4.1
    "topologies/h200-dsv32-2p1d.yml": {"production-rate-24"},  # seed 000 §6
    "topologies/h20-v4flash-tp8.yml": {"short-c1", "short-c8", "long-4k-c4"},  # seed 003 §8.4
    "topologies/h20-v4flash-1p1d-2node.yml": {"short-c1", "short-c8", "long-4k-c4"},  # §11.4
    "topologies/h20-v4flash-sglang-1p1d.yml": {"short-c1", "short-c8", "long-4k-c4"},  # §12.5
    "topologies/h200-dsv32-sglang-dp8.yml": {
        "short-128-4",
        "medium-2000-100",
        "long-4000-200",
        "ultra-32000-100",
        "gen-1000-2000",
    },  # seed 002  # fmt: skip
}


def test_every_shipped_scenario_file_loads() -> None:
    files = sorted(REPO.glob("topologies/**/*.bench.yaml"))
    assert len(files) >= 7
    for bench_file in files:
        topology = bench_file.with_name(bench_file.name.replace(".bench.yaml", ".yml"))
        spec = load_bench(topology)
        assert spec.source == str(bench_file) and spec.scenarios


def test_the_seeds_scenarios_ship_with_their_topologies() -> None:
    for topology, names in SEED_SCENARIOS.items():
        spec = load_bench(REPO / topology)
        assert names <= {s.name for s in spec.scenarios}, topology
    prefill = load_bench(REPO / "topologies/h200-dsv32-tp8.yml").pick(["prefill-4096-1"])[0]
    assert (prefill.input, prefill.output, prefill.requests) == (4096, 1, 256)
    assert prefill.concurrency == (16, 32) and prefill.sla.statistic_for("ttft") == "mean"
    assert (prefill.sla.ttft_s, prefill.sla.prefill_tok_s_per_gpu) == (3, 2000)
    (rate,) = load_bench(REPO / "topologies/h200-dsv32-2p1d.yml").pick(["production-rate-24"])
    assert [p.label for p in rate.load_points()] == ["r24-c170"]
    assert rate.sla.statistic_for("tpot") == "mean" and rate.sla.tpot_ms == 40
    short = load_bench(REPO / "topologies/h20-v4flash-tp8.yml").pick(["short-c8"])[0]
    assert (short.input, short.output, short.concurrency, short.requests, short.warmup) == (
        128, 64, (8,), 64, 8,
    )  # fmt: skip
    assert short.sla.statistic_for("ttft") == "p95"


# ------------------------------------------------------------------ the library API


def test_bench_deployed_reports_a_run_that_could_not_run_as_invalid(
    tmp_path: Path, aiperf_installed: None
) -> None:
    import socket

    from hgxserve.bench.api import BenchRequest, bench_deployed

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    req = BenchRequest(
        REPO / "topologies/demo/demo-pd.yml",
        tmp_path / "runs",
        scenarios=("seed003-long",),
        proxy_url=closed,
        engine_urls={n: closed for n in ("prefill-0", "decode-0", "combined-0")},
    )
    lines: list[str] = []
    outcome = bench_deployed(req, lines.append)
    assert outcome.verdict == "INVALID" and outcome.exit_code == 3
    assert outcome.error is not None and "cannot connect" in outcome.error
    assert [(s.name, s.verdict) for s in outcome.scenarios] == [("seed003-long", "INVALID")]
    assert outcome.run_dir is not None and (outcome.run_dir / "run.json").is_file()
    assert outcome.result["refused"] == outcome.error
    assert not (outcome.run_dir / "report.md").exists()  # nothing was measured


def test_a_run_kept_before_verdicts_is_judged_from_its_points() -> None:
    run = _run("old", [40, 25, 10], [5, 12, 20])  # c16 misses its TTFT and TPOT
    for key in ("verdict", "scenario_verdicts", "invalid"):
        del run[key]
    outcome = outcome_of(None, run)
    assert outcome.verdict == "FAIL" and outcome.exit_code == 1
    (long,) = outcome.scenarios
    assert long.verdict == "FAIL" and long.best() == 12  # c4, the best point that passed
