"""The gate's P/D KV evidence from vLLM decodes' /metrics: NIXL transfers, bytes, and prompt
tokens by source, with what carried the KV across hosts said beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hgxserve.release.gate import (
    GateError,
    GateSpec,
    KvCounters,
    vllm_decode_counters,
    vllm_kv_evidence,
)

REPO = Path(__file__).resolve().parents[2]
LABELS = 'engine="0",model_name="tiny"'


def decode_metrics(transfers: int, nbytes: int, external: int, local: int) -> str:
    """vLLM 0.32 decode /metrics lines as its prometheus_client writes them."""
    return "\n".join(
        [
            "# TYPE vllm:nixl_xfer_time_seconds histogram",
            f'vllm:nixl_xfer_time_seconds_bucket{{{LABELS},le="+Inf"}} {transfers}.0',
            f"vllm:nixl_xfer_time_seconds_count{{{LABELS}}} {transfers}.0",
            f"vllm:nixl_bytes_transferred_sum{{{LABELS}}} {nbytes}.0",
            f"vllm:nixl_num_failed_transfers_total{{{LABELS}}} 0.0",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
            f'vllm:prompt_tokens_by_source_total{{{LABELS},source="local_compute"}} {local}.0',
            f'vllm:prompt_tokens_by_source_total{{{LABELS},source="local_cache_hit"}} 0.0',
            f'vllm:prompt_tokens_by_source_total{{{LABELS},source="external_kv_transfer"}} '
            f"{external}.0",
        ]
    )


def test_counters_sum_over_decodes_and_sources() -> None:
    counters = vllm_decode_counters(
        [decode_metrics(2, 524288, 190, 0), decode_metrics(1, 262144, 60, 8)]
    )
    assert (counters.served, counters.failed, counters.nbytes) == (3.0, 0.0, 786432.0)
    assert counters.tokens == {
        "local_compute": 8.0,
        "local_cache_hit": 0.0,
        "external_kv_transfer": 250.0,
    }


def test_the_gate_says_bytes_tokens_and_tcp() -> None:
    before = vllm_decode_counters([decode_metrics(0, 0, 0, 40)])  # warm-up computed locally
    after = vllm_decode_counters([decode_metrics(4, 1048576, 380, 40)])
    tcp = "KV crossed hosts hgx-a -> hgx-b over TCP (UCX_TLS=tcp names no RDMA transport)"
    said = vllm_kv_evidence(before, after, GateSpec("http://p", "tiny", kv_transport=tcp))
    assert said == (
        "gate: decode pulled KV over NIXL 4 times (1048576 B), prompt tokens from KV transfer "
        f"+380, computed locally +0, 0 failures; {tcp}"
    )
    # an engine without the by-source counter (older vLLM): only what it has
    bare = vllm_kv_evidence(KvCounters(), KvCounters(served=2), GateSpec("http://p", "tiny"))
    assert bare == "gate: decode pulled KV over NIXL 2 times, 0 failures"


def test_transfers_without_prompt_tokens_from_kv_fail_the_gate() -> None:
    before = vllm_decode_counters([decode_metrics(0, 0, 0, 0)])
    after = vllm_decode_counters([decode_metrics(4, 1048576, 0, 380)])
    with pytest.raises(GateError, match="counted no prompt tokens from KV transfer"):
        vllm_kv_evidence(before, after, GateSpec("http://p", "tiny"))


def test_p_d_probes_fit_a_small_context(tmp_path: Path) -> None:
    from hgxserve.release.plan import gate_prompt_words, gate_spec
    from hgxserve.topology import Topology, load_topology

    # max_model_len 256 (the tiny Llama on CPU): 16 words, not 64 (~360 tokens of its tokenizer)
    cpu = load_topology(str(REPO / "topologies/demo/demo-vllm-cpu-pd.yml"))
    assert cpu.proxy is not None and gate_prompt_words(cpu, cpu.proxy) == 16
    spec = gate_spec(cpu)
    assert spec is not None and spec["prompt_words"] == 16
    assert str(spec["kv_transport"]).startswith("KV crossed hosts hgx-a -> hgx-b over TCP")
    # the proxy's split still decides: demo-pd sends prompts under 64 tokens to combined
    pd = load_topology(str(REPO / "topologies/demo/demo-pd.yml"))
    assert pd.proxy is not None and gate_prompt_words(pd, pd.proxy) == 128
    # a KV-aware route prefills on its decode under pd_remote_prefill_min_uncached_tokens: the
    # probes carry at least that many words (a word is one token or more)
    raised = pd.raw | {"proxy": pd.raw["proxy"] | {"pd_min_prompt_tokens": 0}}
    raised["proxy"]["routing"] = {"pd_remote_prefill_min_uncached_tokens": 200}
    wide = dict(raised, defaults=raised["defaults"] | {"args": {"max_model_len": 8192}})

    def _load_raw(data: dict) -> Topology:
        path = tmp_path / "t.yml"
        path.write_text(json.dumps(data))
        return load_topology(str(path))

    kv = _load_raw(wide)
    assert kv.proxy is not None and gate_prompt_words(kv, kv.proxy) == 201
    wide["proxy"]["routing"]["policy"] = "least-outstanding"
    plain = _load_raw(wide)
    assert plain.proxy is not None and gate_prompt_words(plain, plain.proxy) == 64
    # max_model_len 204800, policy kv-events by default: past the 512-token local-prefill bound
    real = load_topology(str(REPO / "topologies/h20-v4flash-4p4d.yml"))
    assert real.proxy is not None and gate_prompt_words(real, real.proxy) == 513
