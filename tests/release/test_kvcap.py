"""The engines' own numbers after a switch: KV capacity readers on the engines' real formats,
the check against the topology's shapes, and the release record that keeps them."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hgxserve.bench.scenario import kv_shapes
from hgxserve.release.kvcap import (
    KvNeed,
    check_release,
    kv_check,
    kv_needs_by_host,
    observation,
    observed_line,
    read_capacity,
    sglang_log_capacity,
    sglang_server_info_capacity,
    topology_needs,
    vllm_log_capacity,
    vllm_metrics_capacity,
)
from hgxserve.release.store import ReleaseSpec, Store, UnitSpec
from hgxserve.release.switch import switch
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"

# vLLM 0.11+ /metrics: CacheConfig.metrics_info() as labels of an info gauge, one per engine core
# (labels as vllm/v1/metrics/loggers.py log_metrics_info writes them: every value a string)
VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="64",cache_dtype="fp8",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.88",\
is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27500",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",\
swap_space="4",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="DeepSeek-V4-Flash"} 0.0
"""
VLLM_METRICS_DP = """\
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="990"} 1.0
"""
VLLM_METRICS_TOKENS = (
    'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="10576",'
    'kv_cache_max_concurrency="2.58203125",num_gpu_blocks="661"} 1.0\n'
)
# vLLM's start log (vllm/v1/core/kv_cache_utils.py: f"{num_tokens:,}")
_VLLM_PREFIX = "(EngineCore_DP0 pid=812) INFO 07-31 10:02:11"
VLLM_LOG = (
    f"{_VLLM_PREFIX} [gpu_worker.py:298] Available KV cache memory: 58.36 GiB\n"
    f"{_VLLM_PREFIX} [kv_cache_utils.py:1087] GPU KV cache size: 1,760,000 tokens\n"
    f"{_VLLM_PREFIX} [kv_cache_utils.py:1091] Maximum concurrency for 204,800 tokens per "
    "request: 8.59x\n"
)
# SGLang's start log (sglang/srt/mem_cache/memory_pool.py), one line per TP rank
SGLANG_LOG = """\
[2025-11-04 05:27:13 DP0 TP0 EP0] Load weight end. type=DeepseekV3ForCausalLM, avail mem=75.11 GB
[2025-11-04 05:27:13 DP0 TP0 EP0] KV Cache is allocated. #tokens: 524288, KV size: 17.16 GB
[2025-11-04 05:27:13 DP0 TP1 EP1] KV Cache is allocated. #tokens: 524288, KV size: 17.16 GB
"""


def test_vllm_metrics_reading_is_blocks_times_block_size() -> None:
    reading = vllm_metrics_capacity(VLLM_METRICS)
    assert reading is not None
    assert (reading.tokens, reading.block_size, reading.ranks, reading.source) == (
        1_760_000,
        64,
        1,
        "metrics",
    )


def test_vllm_metrics_with_dp_ranks_take_the_smallest_pool_and_count_the_ranks() -> None:
    reading = vllm_metrics_capacity(VLLM_METRICS_DP)
    assert reading is not None and (reading.tokens, reading.ranks) == (990 * 16, 2)


def test_vllm_metrics_prefer_kv_cache_size_tokens_where_exported() -> None:
    reading = vllm_metrics_capacity(VLLM_METRICS_TOKENS)
    assert reading is not None and reading.tokens == 10576


def test_vllm_metrics_without_the_info_gauge_or_blocks_read_nothing() -> None:
    assert vllm_metrics_capacity("vllm:num_requests_running 0\n") is None
    assert vllm_metrics_capacity('vllm:cache_config_info{num_gpu_blocks="None"} 1\n') is None


def test_vllm_log_reading_has_the_commas_and_the_concurrency() -> None:
    reading = vllm_log_capacity(VLLM_LOG)
    assert reading is not None
    assert (reading.tokens, reading.max_concurrency, reading.source) == (1_760_000, 8.59, "log")
    assert vllm_log_capacity("Application startup complete.") is None


def test_sglang_log_and_server_info_readings() -> None:
    reading = sglang_log_capacity(SGLANG_LOG)
    assert reading is not None and reading.tokens == 524288
    info = json.dumps({"tp_size": 8, "max_total_num_tokens": 350257, "version": "0.5.8"})
    assert sglang_server_info_capacity(info).tokens == 350257  # type: ignore[union-attr]
    per_rank = json.dumps({"internal_states": [{"max_total_num_tokens": 9000}]})
    assert sglang_server_info_capacity(per_rank).tokens == 9000  # type: ignore[union-attr]
    assert sglang_server_info_capacity("{}") is None
    assert sglang_server_info_capacity("not json") is None


class _Engine(http.server.BaseHTTPRequestHandler):
    metrics = VLLM_METRICS

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            body = b""
        elif self.path == "/metrics":
            body = self.metrics.encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()


def test_read_capacity_takes_the_metrics_and_the_log_concurrency(engine_url: str) -> None:
    reading = read_capacity(engine_url, VLLM_LOG)
    assert reading is not None
    assert (reading.tokens, reading.source, reading.max_concurrency) == (
        1_760_000,
        "metrics",
        8.59,
    )


def test_read_capacity_falls_back_to_the_log_when_nothing_answers() -> None:
    reading = read_capacity("http://127.0.0.1:9/health", SGLANG_LOG)
    assert reading is not None and (reading.tokens, reading.source) == (524288, "log")
    assert read_capacity("http://127.0.0.1:9/health", "no capacity here") is None


NEED = KvNeed("decode-0", 288, "warm-up 128x16x2: 2 x (128+16)", dp=1, fit_tokens=1_000)


def test_a_capacity_below_the_need_is_short_with_the_numbers() -> None:
    entry = observation(12.34, vllm_log_capacity("GPU KV cache size: 128 tokens"))
    verdict, fields = kv_check("hgxserve-decode-0.service", entry, NEED)
    assert verdict == "short" and fields["kv_verdict"] == "short"
    message = fields["kv_message"]
    assert "holds 128 KV tokens" in message and "below the 288" in message
    assert "warm-up 128x16x2: 2 x (128+16)" in message
    assert "the fit estimate was 1,000 per DP rank (engine/estimate 0.13)" in message
    assert fields["kv_fit_ratio"] == 0.128 and fields["kv_need_tokens"] == 288


def test_a_capacity_times_dp_ranks_that_holds_the_shape_is_ok() -> None:
    entry = observation(3.0, vllm_log_capacity("GPU KV cache size: 200 tokens"))
    need = KvNeed("combined-0", 288, "warm-up", dp=2, fit_tokens=None)
    verdict, fields = kv_check("hgxserve-combined-0.service", entry, need)
    assert verdict == "ok" and "holds 400 KV tokens (2 DP ranks x 200" in fields["kv_message"]
    assert "no fit estimate" in fields["kv_message"] and fields["kv_fit_ratio"] is None


def test_an_engine_that_reports_nothing_is_unread_not_short() -> None:
    verdict, fields = kv_check("hgxserve-x.service", observation(1.0, None), NEED)
    assert verdict == "unread" and "reported no KV capacity" in fields["kv_message"]
    assert "reported" in observed_line("hgxserve-x.service", observation(1.0, None))


def _store(tmp_path: Path) -> Store:
    store = Store(str(tmp_path / "lib"), system_root=str(tmp_path / "sys"))
    (store.release_dir("r1") / "tree").mkdir(parents=True)
    return store


def test_check_release_keeps_need_ratio_and_verdict_in_the_record(tmp_path: Path) -> None:
    store = _store(tmp_path)
    unit = "hgxserve-decode-0.service"
    store.note_observed("r1", unit, observation(41.2, vllm_log_capacity(VLLM_LOG)))
    lines: list[str] = []
    short = check_release(store, "r1", {unit: NEED}, lines.append)
    assert short == []
    record = store.observed("r1")[unit]
    assert record["start_s"] == 41.2 and record["kv_tokens"] == 1_760_000
    assert record["kv_verdict"] == "ok" and record["kv_fit_ratio"] == 1760.0
    assert lines and lines[0].startswith("KV ok: decode-0")
    small = observation(5.0, vllm_log_capacity("GPU KV cache size: 16 tokens"))
    store.note_observed("r1", unit, small, replace=True)
    short = check_release(store, "r1", {unit: NEED}, lines.append)
    assert len(short) == 1 and "below the 288" in short[0]
    assert lines[-1].startswith("KV SHORT: decode-0")
    assert store.observed("r1")[unit]["kv_verdict"] == "short"


def test_store_status_shows_the_running_release_record_and_carries_kept_units(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    (store.release_dir("r2") / "tree").mkdir(parents=True)
    store.note_observed("r1", "hgxserve-a.service", {"start_s": 9.0, "kv_tokens": 100})
    store.note_observed("r1", "hgxserve-b.service", {"start_s": 8.0, "kv_tokens": 50})
    store.carry_observed("r1", "r2", frozenset({"hgxserve-a.service"}))
    assert store.observed("r2") == {
        "hgxserve-a.service": {"start_s": 9.0, "kv_tokens": 100, "kept_from": "r1"}
    }
    store.set_link("current", "r2")
    assert store.status()["observed"] == store.observed("r2")
    assert store.observed("nothing-here") == {}


def test_a_switch_records_each_engine_start_time_and_kv_capacity(
    tmp_path: Path, engine_url: str
) -> None:
    from tests.release.test_switch import FakeSystemd, stage

    store = Store(str(tmp_path / "lib"), system_root=str(tmp_path / "sys"))
    spec = stage(store, "r1", ["hgxserve-decode-0.service", "hgxserve-proxy.service"])
    spec.units[0] = UnitSpec("hgxserve-decode-0.service", "engine", engine_url, [])
    (store.release_dir("r1") / "release.json").write_text(spec.to_json())
    sd = FakeSystemd()
    sd.journals["hgxserve-decode-0.service"] = VLLM_LOG + "Application startup complete.\n"
    said: list[str] = []
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=said.append)
    record = store.observed("r1")
    assert set(record) == {"hgxserve-decode-0.service"}  # the proxy reports no KV
    entry = record["hgxserve-decode-0.service"]
    assert entry["kv_tokens"] == 1_760_000 and entry["kv_source"] == "metrics"
    assert entry["start_s"] >= 0 and entry["kv_max_concurrency"] == 8.59
    assert any(
        line.startswith("hgxserve-decode-0.service: served after")
        and "KV capacity 1,760,000 tokens per DP rank (metrics)" in line
        for line in said
    ), said
    assert ReleaseSpec.from_json(spec.to_json()).units[0].health_url == engine_url


def test_the_demo_topologys_needs_from_warm_up_and_bench_shapes() -> None:
    topo = load_topology(PD)
    warm_only = topology_needs(topo, [])
    # every engine gets every warm-up shape at full concurrency: 2 x (128+16) is the largest
    assert {n: (v.need_tokens, v.shape) for n, v in warm_only.items()} == {
        name: (288, "warm-up 128x16x2: 2 x (128+16)")
        for name in ("prefill-0", "decode-0", "combined-0")
    }
    bench = kv_shapes(PD)  # demo-pd.bench.yaml beside it
    assert ("pd-long", 240, 32, 4) in bench and ("combined-short", 24, 16, 4) in bench
    needs = topology_needs(topo, bench)
    assert needs["prefill-0"].need_tokens == 4 * 241  # a P/D prefill holds the prompt + 1
    assert needs["prefill-0"].shape == "bench pd-long c4: 4 x (240+1)"
    assert needs["decode-0"].need_tokens == 4 * 272
    assert needs["combined-0"].need_tokens == 288  # combined-short c4 needs only 4 x 40
    by_host = kv_needs_by_host(topo, bench)
    assert by_host["hgx-b"] == {
        "hgxserve-decode-0.service": {
            "engine": "decode-0",
            "need_tokens": 1088,
            "shape": "bench pd-long c4: 4 x (240+32)",
            "dp": 1,
            "fit_tokens": None,
        }
    }
    assert KvNeed.from_dict(by_host["hgx-b"]["hgxserve-decode-0.service"]).need_tokens == 1088


def test_no_bench_scenarios_means_no_bench_shapes(tmp_path: Path) -> None:
    copy = tmp_path / "pd.yml"
    copy.write_text(PD.read_text())
    assert kv_shapes(copy) == [] and kv_shapes(None) == []


def test_plan_shows_the_last_release_numbers_against_this_topology(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hgxserve.cli.topology import plan

    decode = {"start_s": 41.2, "kv_tokens": 512, "kv_source": "metrics"}
    prefill = {"start_s": 30.0, "kv_tokens": 2048, "kv_source": "log"}
    report = {  # a `status --json` report, and the same record as a bench run.json keeps it
        "hosts": {
            "hgx-b": {"snapshot": {"units": [{"name": "hgxserve-decode-0.service",
                                              "observed": decode}]}},
            "hgx-a": {"snapshot": {"units": [{"name": "hgxserve-proxy.service"}]}},
        },
        "engines_observed": {"hgx-a": {"hgxserve-prefill-0.service": prefill}},
    }  # fmt: skip
    last = tmp_path / "status.json"
    last.write_text(json.dumps(report))
    text = CliRunner().invoke(plan, [str(PD), "--last", str(last)])
    assert text.exit_code == 0, text.output
    assert f"last release ({last}): start time and KV capacity against this topology" in text.output
    assert (
        "  decode-0: started in 41.2s; decode-0 (hgxserve-decode-0.service) holds 512 KV tokens "
        "(1 DP rank, from its metrics), below the 1,088 its largest shape needs (bench pd-long "
        "c4: 4 x (240+32))"
    ) in text.output
    assert "  prefill-0: started in 30.0s; prefill-0 (hgxserve-prefill-0.service) holds 2,048" in (
        text.output
    )
    data = json.loads(
        CliRunner().invoke(plan, [str(PD), "--last", str(last), "--format", "json"]).output
    )
    engines = data["last_release"]["engines"]
    assert set(engines) == {"decode-0", "prefill-0"}
    assert engines["decode-0"]["kv_verdict"] == "short" and engines["decode-0"]["start_s"] == 41.2


def test_the_hosts_release_switch_loads_no_renderer_or_topology() -> None:
    """Every release step on a host runs `hgxserve release ...`: the KV capacity check it
    imports keeps the controller's side (topology model, fit estimate, unit renderer, jinja2)
    out of it, which took its start from 0.14 s to 0.5 s."""
    code = (
        "import sys, hgxserve.cli.release; "
        "print(' '.join(m for m in ('hgxserve.render', 'hgxserve.topology.model', "
        "'hgxserve.topology.fit', 'jinja2') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == ""
