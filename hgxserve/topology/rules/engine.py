"""Rules on any engine's args, vLLM and SGLang alike: eplb-*, heads-per-rank, max-num-seqs-unset,
served-name, extra-args-typed, extra-args-known.

EPLB settings the seeds measured, DSA heads per TP rank (with advice from the fit estimate),
CUDA-graph capture bounded by max_num_seqs, the served name the proxy routes by, and extra_args
that would bypass the typed fields and the rules that check them, read as the engine's parser
reads them (hgxserve.topology.engine_flags), each a flag the engine takes, written in full.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology import fit
from hgxserve.topology.engine_args import arg_of_flag
from hgxserve.topology.engine_flags import ExtraFlag, flags_source
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import proxy_targets, setting_path
from hgxserve.topology.registry import Finding, engine_rule
from hgxserve.topology.rules.common import BLACKWELL, HOPPER, accept_hint, extra_flags, gpu_kinds

FAMILY = (
    "eplb-",
    "heads-per-rank",
    "max-num-seqs-unset",
    "served-name",
    "extra-args-typed",
    "extra-args-known",
)


@engine_rule(
    "heads-per-rank",
    "warning",
    "DSA (FlashMLA-sparse): heads per TP rank a multiple of 64 on Hopper, 128 on Blackwell.",
    why=(
        "seed 000 §4.4.2: 128 heads -> TP in {1, 2} on Hopper; larger TP pads heads and "
        "wastes work. The advice names only a tp that fits on one host and holds the weights "
        "(with `ep: true` where only that fits, from the fit estimate)"
    ),
)
def heads_per_rank(topo: Topology, engine: Engine) -> Iterator[Finding]:
    arch = topo.model.architecture
    heads = arch.attention_heads
    if arch.attention != "dsa" or not heads:
        return
    kinds = gpu_kinds(topo, engine)
    if not kinds:
        return
    granule = 128 if any(k in BLACKWELL for k in kinds) else 64
    if not any(k in HOPPER + BLACKWELL for k in kinds):
        return
    attention_tp = engine.tp
    note = ""
    if engine.dp_attention and engine.dp > 1:
        attention_tp = max(1, engine.tp // engine.dp)
        note = f" (DP attention: tp {engine.tp} / dp {engine.dp})"
    per_rank = heads // attention_tp
    if heads % attention_tp == 0 and per_rank % granule == 0:
        return
    yield (
        setting_path(topo, engine.name, "tp"),
        f"{heads} attention heads / tp {attention_tp}{note} = {per_rank} heads per rank; "
        f"FlashMLA-sparse (DSA) on {'/'.join(kinds)} computes heads per rank in multiples of "
        f"{granule}, so each rank pads to {granule} and wastes work (seed 000 §4.4.2: "
        f"DeepSeek V3.2 128 heads -> TP in {{1, 2}} on Hopper); "
        + _heads_advice(topo, engine, heads, granule),
    )


def _heads_advice(topo: Topology, engine: Engine, heads: int, granule: int) -> str:
    """Which tp to use instead: only sizes that divide the heads into whole granules, fit on
    one host, and hold the weights (with expert parallelism where that is what makes them fit)."""
    host_gpus = min((topo.hosts[h].gpus for h in engine.hosts if h in topo.hosts), default=8)
    sizes = [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= host_gpus and heads % t == 0 and (heads // t) % granule == 0
    ]
    try:
        facts = fit.model_facts(topo)
    except fit.ConfigError:
        facts = None
    estimate = fit.engine_fit(topo, engine, facts) if facts else None
    if not sizes:
        return "no tp divides the heads into whole multiples; keep the padding"
    if facts is None or estimate is None:
        return _heads_advice_by_size(topo, engine, sizes)
    plain, with_ep = [], []
    for t in sizes:
        if fit.weights_per_gpu(facts, engine, tp=t, ep=engine.ep) <= estimate.budget:
            plain.append(t)
        elif not engine.ep and fit.weights_per_gpu(facts, engine, tp=t, ep=True) <= estimate.budget:
            with_ep.append(t)
    if plain:
        return "use tp in {" + ", ".join(map(str, plain)) + "} with dp for more GPUs"
    if with_ep:
        return (
            "use tp in {" + ", ".join(map(str, with_ep)) + "} with dp and ep: true (at those "
            "sizes only expert parallelism makes the weights fit)"
        )
    return (
        "no tp with whole multiples holds the weights on these GPUs "
        f"(tried {', '.join(map(str, sizes)) or 'none'}); keep tp {engine.tp} and the padding"
    )


def _heads_advice_by_size(topo: Topology, engine: Engine, sizes: list[int]) -> str:
    """Advice without a model config: the model's size over tp must fit a GPU's budget."""
    listed = "{" + ", ".join(map(str, sizes)) + "}"
    gpu = topo.hosts[engine.head].gpu if engine.head in topo.hosts else None
    size = topo.model.size
    if size is None or gpu not in fit.GPU_MEMORY_MIB:
        return (
            f"use tp in {listed} with dp for more GPUs if the weights fit at that tp (set "
            "model.config or model.size to have that checked)"
        )
    budget = fit.GPU_MEMORY_MIB[gpu] * fit.MIB * fit.utilization(engine)
    fitting = [t for t in sizes if size / t <= budget]
    if fitting:
        return "use tp in {" + ", ".join(map(str, fitting)) + "} with dp for more GPUs"
    return (
        f"no tp in {listed} holds the model's {fit.gib(size)} GiB on one {gpu}; keep tp "
        f"{engine.tp} and the padding (or set model.config to check tp with ep: true)"
    )


@engine_rule(
    "eplb-log-balancedness",
    "warning",
    "EPLB log_balancedness is off where decode runs.",
    why="seed 000 §5.3.2: decode 4969.65 -> 1618.92 tok/s",
)
def eplb_log_balancedness(topo: Topology, engine: Engine) -> Iterator[Finding]:
    eplb = engine.args.get("eplb_config") or {}
    if engine.role in ("decode", "combined") and eplb.get("log_balancedness") is True:
        yield (
            setting_path(topo, engine.name, "args", "eplb_config", "log_balancedness"),
            "EPLB log_balancedness copies expert load from GPU to host every step (24 ms "
            "eplb-step): seed 000 §5.3.2 measured decode output 4969.65 tok/s without EPLB "
            "and 1618.92 tok/s with it, 5339.16 after the fix; set log_balancedness: false",
        )


@engine_rule(
    "eplb-redundant-experts",
    "warning",
    "Multi-host EPLB has redundant experts (about one per GPU).",
    why="seed 001 §3.1 step 3: ideally one redundant expert per GPU; too many take HBM",
)
def eplb_redundant_experts(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not engine.args.get("enable_eplb") or not engine.is_multi_node or engine.redundant_experts:
        return
    gpus = engine.gpu_count
    yield (
        setting_path(topo, engine.name, "args", "eplb_config"),
        f"EPLB across {len(engine.place)} hosts without redundant experts can only move "
        "experts, not replicate the hot ones; seed 001 §3.1 step 3: about one redundant "
        f"expert per GPU is best (more take HBM from the KV cache); set "
        f"eplb_config.num_redundant_experts: {gpus} ({gpus} GPUs)",
    )


@engine_rule(
    "max-num-seqs-unset",
    "warning",
    "max_num_seqs is set (bounds CUDA-graph capture).",
    why="seed 003 §5, §12.2: CUDA graphs captured for shapes never used (51 shapes, 394 s)",
)
def max_num_seqs_unset(topo: Topology, engine: Engine) -> Iterator[Finding]:
    peak = max((w.concurrency for w in topo.warmup), default=None)
    hint = f" (the largest warmup concurrency is {peak})" if peak else ""
    if "max_num_seqs" in engine.args or engine.args.get("enforce_eager"):
        return
    yield (
        setting_path(topo, engine.name, "args"),
        "max_num_seqs is not set: the engine default captures CUDA graphs for batch shapes "
        "never used and lengthens every cold start (seed 003 §5, §12.2: 51 shapes in 394 s); "
        f"set args.max_num_seqs to the concurrency you serve{hint}",
    )


@engine_rule(
    "served-name",
    "error",
    "Every engine the proxy routes to serves the model's served_name.",
    why="the proxy routes by served name; a different name answers 404",
)
def served_name(topo: Topology, engine: Engine) -> Iterator[Finding]:
    targets = proxy_targets(topo)
    name = engine.extra_arg("--served-model-name")
    if name is None or name == topo.model.served_name:
        return
    routed = " the proxy routes it requests for" if engine.name in targets else " clients ask"
    yield (
        setting_path(topo, engine.name, "extra_args"),
        f"{engine.name} serves '{name}' (--served-model-name in extra_args) but{routed} "
        f"'{topo.model.served_name}' (model.served_name); remove the flag",
    )


# flags the renderer writes from typed fields; repeating them in extra_args bypasses the rules
TYPED_FLAGS = {
    "--port": "port",
    "--host": "bind",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--tp-size": "tp",
    "--tp": "tp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
    "--dp-size": "dp",
    "--dp": "dp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--pp-size": "pp",
    "--enable-expert-parallel": "ep",
    "--ep-size": "ep",
    "--kv-transfer-config": "kv",
    "--disaggregation-mode": "role",
    "--disaggregation-bootstrap-port": "kv.bootstrap_port",
    "--data-parallel-rpc-port": "rpc_port",
    # every flag the renderers write for a typed arg (the one table, ARG_FLAGS)
    **{name: f"args.{key}" for name, key in arg_of_flag().items()},
}


@engine_rule(
    "extra-args-typed",
    "error",
    "extra_args do not repeat flags that typed fields render, in any spelling the engine takes "
    "(`_` for `-`, a prefix, a dotted sub-key).",
    why="a flag in extra_args bypasses the GPU, port, P/D and remote-code checks",
)
def extra_args_typed(topo: Topology, engine: Engine) -> Iterator[Finding]:
    for path, flag in extra_flags(topo, engine):
        names = (flag.written, flag.name, flag.flag)
        field = next((TYPED_FLAGS[n] for n in names if n in TYPED_FLAGS), None)
        if field is None:
            continue
        shown = flag.written
        if flag.written != flag.flag:
            shown += f" ({_taken_as(engine, flag)})"
        yield (
            path,
            f"{shown} in extra_args duplicates the typed field {field}; set {field} "
            "instead (extra_args bypass the P/D, GPU and port checks)",
        )


def _taken_as(engine: Engine, flag: ExtraFlag) -> str:
    seen = flag.flag or flag.name
    sub = f" sub-key {flag.subkey}" if flag.subkey else ""
    return f"{engine.engine} reads it as {seen}{sub}"


@engine_rule(
    "extra-args-known",
    "error",
    "Every flag in extra_args is one the engine's serve parser takes, written in full "
    "(hgxserve/topology/engine_flags.json); a flag the list lacks is accepted by its path.",
    why=(
        "argparse takes any unambiguous prefix and vLLM `_` for `-`: a flag the rules do not "
        "know by name could be one they refuse (`--trust-remote`, `--worker-extension`), and "
        "a prefix means another flag once a new engine version adds one"
    ),
)
def extra_args_known(topo: Topology, engine: Engine) -> Iterator[Finding]:
    for path, flag in extra_flags(topo, engine):
        if flag.flag is not None and not flag.abbreviated:
            continue
        if flag.abbreviated:
            yield (
                path,
                f"{flag.written} is an abbreviation: {engine.engine}'s parser takes it for "
                f"{flag.flag}; write {flag.flag} in full",
            )
        elif flag.candidates:
            few = ", ".join(flag.candidates[:4]) + (", ..." if len(flag.candidates) > 4 else "")
            yield (
                path,
                f"{flag.written} is a prefix of {len(flag.candidates)} {engine.engine} flags "
                f"({few}): {engine.engine} refuses it at start; write the flag in full",
            )
        else:
            yield (
                path,
                f"{flag.written} is not a flag of {engine.engine}'s serve parser (the flags of "
                f"{_versions(engine)}, hgxserve/topology/engine_flags.json): check its "
                f"spelling; a flag of another engine version: {accept_hint(path)}",
            )


def _versions(engine: Engine) -> str:
    source = flags_source(engine.engine)
    return source.split(" (", 1)[0].removeprefix("PyPI ")
