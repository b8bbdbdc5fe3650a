"""Rules that check SGLang engines only: sglang-*.

DP attention that needs dp > 1 dividing tp, DeepGEMM kept on for DSA models, and a /health that
does not generate.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import Finding, engine_rule, sparse_attention

FAMILY = ("sglang-",)


_FALSE = ("0", "false", "no", "off")


def _falsy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _FALSE


@engine_rule(
    "sglang-health-generation",
    "warning",
    "SGLang /health does not generate (it pollutes load tests and P/D).",
    engine="sglang",
    why="seed 003 §12.4: a 256-token prefill every 10 s polluted the load test",
)
def sglang_health_generation(topo: Topology, engine: Engine) -> Iterator[Finding]:
    value = engine.env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
    if value is None or value.lower() in ("0", "false", "no", "off", ""):
        return
    extra = (
        "; on a P/D engine a generating probe also needs its peer and can hang"
        if engine.role != "combined"
        else ""
    )
    yield (
        setting_path(topo, engine.name, "env", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"),
        "a generative /health runs a real prefill on every probe (seed 003 §12.4: a "
        f"256-token prefill every 10 s polluted TTFT and throughput){extra}; set it to 0 "
        "(the hgxserve default)",
    )


@engine_rule(
    "sglang-dp-attention",
    "error",
    "SGLang DP attention needs dp > 1 dividing tp.",
    engine="sglang",
    why="SGLang needs dp > 1 dividing tp for DP attention (seed 002: tp 8 dp 8)",
)
def sglang_dp_attention(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not engine.args.get("enable_dp_attention"):
        return
    if engine.dp < 2 or engine.tp % engine.dp:
        yield (
            setting_path(topo, engine.name, "dp"),
            f"enable_dp_attention splits tp {engine.tp} into dp attention groups: dp must be "
            f"> 1 and divide tp, got dp {engine.dp} (seed 002: --tp-size 8 --dp-size 8 "
            "--enable-dp-attention)",
        )


@engine_rule(
    "sglang-jit-deepgemm",
    "error",
    "SGLang keeps DeepGEMM on for DSA models (SGLANG_ENABLE_JIT_DEEPGEMM=0 stops the server).",
    engine="sglang",
    when=sparse_attention,
    why="seed 002: the server could not start",
)
def sglang_jit_deepgemm(topo: Topology, engine: Engine) -> Iterator[Finding]:
    value = engine.env.get("SGLANG_ENABLE_JIT_DEEPGEMM")
    if not _falsy(value):
        return
    yield (
        setting_path(topo, engine.name, "env", "SGLANG_ENABLE_JIT_DEEPGEMM"),
        f"SGLANG_ENABLE_JIT_DEEPGEMM={value} turns DeepGEMM off, and SGLang could not start "
        "DeepSeek-V3.2 without it (seed 002: 'disabling DeepGEMM, the server cannot "
        "start'); remove the variable",
    )
