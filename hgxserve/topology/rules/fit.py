"""Rules on the memory / KV-cache fit estimate (hgxserve.topology.fit): fit-* and model-config.

The model config the estimate reads is readable; the weights fit each GPU's budget, the KV cache
holds one sequence of max_model_len, no shape a seed saw run out of memory, and max_num_seqs and
the warm-up concurrency fit in the estimated KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps

from hgxserve.topology import fit
from hgxserve.topology.model import Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.problems import Severity
from hgxserve.topology.registry import Finding, RuleFunc, rule

FAMILY = ("fit-", "model-config")


FitCheck = Callable[[Topology, str, fit.EngineFit], Iterator[Finding]]


def _fits(topo: Topology) -> dict[str, fit.EngineFit]:
    try:
        return fit.topology_fit(topo)[1]
    except fit.ConfigError:
        return {}  # model-config reports it


def fit_rule(
    rule_id: str, severity: Severity, summary: str, *, why: str
) -> Callable[[FitCheck], RuleFunc]:
    """Register a rule that looks at each engine's fit estimate in turn (none while the model
    config cannot be read): the function gets the engine's name and its estimate."""

    def register(func: FitCheck) -> RuleFunc:
        @wraps(func)
        def check(topo: Topology) -> Iterator[Finding]:
            for name, est in _fits(topo).items():
                yield from func(topo, name, est)

        return rule(rule_id, severity, summary, why=why)(check)

    return register


@rule(
    "model-config",
    "warning",
    "model.config names a readable config.json with the fields the fit estimate needs.",
    why="no estimate without it",
)
def model_config(topo: Topology) -> Iterator[Finding]:
    try:
        fit.model_facts(topo)
    except fit.ConfigError as exc:
        yield (
            ("model", "config"),
            f"{exc}; without it there is no memory / KV-cache fit estimate (docs/fit.md)",
        )


@fit_rule(
    "fit-weights",
    "error",
    "The weights alone fit in each GPU's memory budget.",
    why="docs/fit.md",
)
def fit_weights(topo: Topology, name: str, est: fit.EngineFit) -> Iterator[Finding]:
    if est.weights <= est.budget:
        return
    engine = topo.engines[name]
    yield (
        setting_path(topo, name, "tp"),
        f"{name}: weights alone take ~{fit.gib(est.weights)} GiB per GPU, more than the "
        f"{fit.gib(est.budget)} GiB budget ({est.gpu} {fit.gib(est.gpu_bytes)} GiB x "
        f"gpu_memory_utilization {est.utilization}), so loading them runs out of memory "
        "(seed 003 §1: even V4-Flash's 155 GiB on 8 x H20 left 'little headroom'); place "
        f"more GPUs under a larger tp than {engine.tp}"
        + (" or turn on ep (experts split over tp x dp)" if not engine.ep else "")
        + " (estimate: docs/fit.md)",
    )


@fit_rule(
    "fit-context",
    "error",
    "The KV cache holds at least one sequence of max_model_len tokens.",
    why="docs/fit.md; seed 002: full 163840 context OOM, 81920 works",
)
def fit_context(topo: Topology, name: str, est: fit.EngineFit) -> Iterator[Finding]:
    if est.weights > est.budget or not est.max_model_len:
        return
    if est.kv_tokens >= est.max_model_len:
        return
    need = est.max_model_len * est.kv_bytes_per_token
    yield (
        setting_path(topo, name, "args", "max_model_len"),
        f"{name}: one sequence of max_model_len {est.max_model_len} needs "
        f"~{fit.gib(need)} GiB of KV cache per GPU, but ~{fit.gib(est.kv_bytes)} GiB is "
        f"left ({fit.gib(est.budget)} budget - {fit.gib(est.weights)} weights - "
        f"{fit.gib(est.allowance)} workspace, activations and non-torch), ~{est.kv_tokens} "
        "tokens; vLLM "
        "refuses to start ('To serve at least one request with the models's max seq len') "
        f"(seed 002: DeepSeek-V3.2 TP1 x DP8 on 8 x H200 OOMs at the full 163840, runs at "
        f"81920); lower max_model_len to <= {est.kv_tokens} or raise gpu_memory_utilization",
    )


@fit_rule(
    "fit-seed-oom",
    "warning",
    "No engine has a shape a seed saw run out of memory where the estimate says it fits.",
    why=("docs/fit.md; seed 002: V3.2 TP1 x DP8 + EP at 163840 OOM, 81920 ran; LMCache PR 2521"),
)
def fit_seed_oom(topo: Topology, name: str, est: fit.EngineFit) -> Iterator[Finding]:
    if est.status != "seed-oom" or not est.max_model_len:
        return
    need = est.max_model_len * est.kv_bytes_per_token
    yield (
        setting_path(topo, name, "args", "max_model_len"),
        f"{name}: max_model_len {est.max_model_len} with every attention head on each "
        f"GPU: {est.seed_failure}. The estimate leaves ~{fit.gib(est.kv_bytes)} GiB of KV "
        f"per GPU where one sequence needs ~{fit.gib(need)} and does not explain that "
        f"failure (docs/fit.md); set max_model_len <= {fit.SEED_DSA_TP1_WORKING_LEN} or "
        "split attention (tp 2 with dp 4 ran in LMCache PR 2521)",
    )


@fit_rule(
    "fit-concurrency",
    "warning",
    "max_num_seqs and the warm-up concurrency fit in the estimated KV cache.",
    why="docs/fit.md; seed 001 §3.1 step 5, seed 003 §8.2",
)
def fit_concurrency(topo: Topology, name: str, est: fit.EngineFit) -> Iterator[Finding]:
    if est.status == "no-fit" or not est.longest_shape:
        return
    engine = topo.engines[name]
    per_rank = est.longest_capacity or 0
    if "max_num_seqs" in engine.args and est.max_num_seqs > per_rank:
        yield (
            setting_path(topo, name, "args", "max_num_seqs"),
            f"{name}: max_num_seqs {engine.args['max_num_seqs']}"
            + (
                f" ({est.max_num_seqs} per DP rank)"
                if est.max_num_seqs != engine.args["max_num_seqs"]
                else ""
            )
            + f", but the KV cache (~{est.kv_tokens} tokens per rank) holds only "
            f"{per_rank} sequences of the longest warm-up length ({est.longest_shape} "
            "tokens); the rest wait or are preempted (seed 001 §3.1 step 5: size batching "
            f"and memory utilisation to avoid OOM); lower max_num_seqs to {per_rank} or "
            "give the engine more KV memory",
        )
    for shape in est.shapes:
        if shape.concurrency <= shape.capacity:
            continue
        index = next(
            i
            for i, w in enumerate(topo.warmup)
            if (w.input, w.output, w.concurrency) == (shape.input, shape.output, shape.concurrency)
        )
        yield (
            ("warmup", index, "concurrency"),
            f"concurrency {shape.concurrency} of {shape.input}+{shape.output}-token "
            f"requests does not fit {name}'s KV cache: it holds {shape.capacity} such "
            f"sequences (~{est.kv_tokens} tokens x {est.dp_ranks} DP rank(s)), so the "
            "warm-up queues instead of compiling the shape it should (seed 003 §8.2); lower "
            "the concurrency or give the engine more KV memory",
        )
