"""Rules for engine settings that failed a start or slowed an engine in the seeds.

Attention backends the model's attention cannot use, decode context parallel with sparse
FlashMLA, DeepGEMM switched off under SGLang, the removed VLLM_ATTENTION_BACKEND variable, DP
padding synchronised over the CPU, and EPLB across hosts without redundant experts. Each message
carries the seed's evidence. Registered with `@engine_rule` and `@rule` like the rules in
`checks`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from hgxserve.topology import cuda, fit
from hgxserve.topology.checks import (
    HOPPER,
    VLLM_NCCL_DP_SYNC,
    _gpu_kinds,
    _override,
    _show_version,
    _version,
)
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import (
    Finding,
    data_parallel,
    engine_rule,
    rule,
    sparse_attention,
)

# vLLM removed the VLLM_ATTENTION_BACKEND variable after deprecating it (PR 26315, "will be
# removed in v0.14.0"); vLLM 0.26.0 has no reader of it left (vllm-project/vllm#50292).
VLLM_ATTENTION_ENV_REMOVED = (0, 14, 0)
# vLLM turned async scheduling on by default in 0.14.0; before, it ran only when asked for.
VLLM_ASYNC_DEFAULT = (0, 14, 0)
# Attention kinds that keep a latent KV (MLA) and need an MLA backend; dsa also needs a sparse one.
LATENT_KINDS = ("mla", "dsa")
# vLLM MLA backends whose kernels exist only on Blackwell (SM100).
BLACKWELL_ONLY_BACKENDS = ("CUTLASS_MLA", "FLASHINFER_MLA")
SPARSE_BACKEND = "FLASHMLA_SPARSE"
_FALSE = ("0", "false", "no", "off")


def _falsy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _FALSE


# -- attention -----------------------------------------------------------------------------------


def _backend_problem(attention: str, backend: str, kinds: list[str]) -> str | None:
    """Why vLLM refuses `backend` for a model with `attention`, in vLLM's own words."""
    name = backend.upper()
    reasons = []
    if attention in LATENT_KINDS and "MLA" not in name:
        reasons.append("MLA not supported")
    if attention not in LATENT_KINDS and "MLA" in name:
        reasons.append("non-MLA model")
    if attention == "dsa" and "MLA" in name and "SPARSE" not in name:
        reasons.append("sparse not supported")
    if name in BLACKWELL_ONLY_BACKENDS and kinds and all(k in HOPPER for k in kinds):
        reasons.append("compute capability not supported")
    if not reasons:
        return None
    return (
        f"Selected backend AttentionBackendEnum.{name} is not valid for this configuration. "
        f"Reason: {reasons!r}"
    )


@engine_rule(
    "attention-backend",
    "error",
    "vLLM's attention backend can run the model's attention (MLA needs an MLA backend, DSA a "
    "sparse one).",
    engine="vllm",
)
def attention_backend(topo: Topology, engine: Engine) -> Iterator[Finding]:
    attention = topo.model.architecture.attention
    if attention is None:
        return
    kinds = _gpu_kinds(topo, engine)
    for backend, path in (
        (engine.args.get("attention_backend"), ("args", "attention_backend")),
        (engine.env.get("VLLM_ATTENTION_BACKEND"), ("env", "VLLM_ATTENTION_BACKEND")),
    ):
        if not backend:
            continue
        why = _backend_problem(attention, str(backend), kinds)
        if why is None:
            continue
        fix = {
            "dsa": f"use {SPARSE_BACKEND} (or leave the backend unset)",
            "mla": "use an MLA backend such as FLASHMLA or TRITON_MLA (or leave it unset)",
        }.get(attention, "use a non-MLA backend such as FLASH_ATTN (or leave it unset)")
        yield (
            setting_path(topo, engine.name, *path),
            f"the model's attention is {attention} and vLLM refuses {backend} at start-up: "
            f"'{why}' (seed 002: CUTLASS_MLA, FLASHMLA and TRITON_MLA all refused with "
            f"'sparse not supported' for DeepSeek-V3.2); {fix}",
        )


_DCP_FLAGS = ("-dcp", "--decode-context-parallel-size")


@engine_rule(
    "dcp-sparse",
    "error",
    "No decode context parallel with DSA (FlashMLA-sparse returns no softmax LSE).",
    engine="vllm",
    when=sparse_attention,
)
def dcp_sparse(topo: Topology, engine: Engine) -> Iterator[Finding]:
    value = _override(engine, *_DCP_FLAGS)
    if value is None or value.strip() == "1":
        return
    yield (
        setting_path(topo, engine.name, "extra_args"),
        f"decode context parallel ({value}) needs the softmax log-sum-exp of each rank's "
        "attention to merge them, and the FlashMLA-sparse backend that DSA models use does "
        "not return it in decode: the engine fails (seed 002: DeepSeek-V3.2 -tp 8 -dcp 8; "
        "vLLM issue 27544); remove the decode-context-parallel flag",
    )


@engine_rule(
    "sglang-jit-deepgemm",
    "error",
    "SGLang keeps DeepGEMM on for DSA models (SGLANG_ENABLE_JIT_DEEPGEMM=0 stops the server).",
    engine="sglang",
    when=sparse_attention,
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


@engine_rule(
    "vllm-attention-backend-env",
    "error",
    "No VLLM_ATTENTION_BACKEND env on vLLM >= 0.14 (ignored); use args.attention_backend.",
    engine="vllm",
)
def vllm_attention_backend_env(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if "VLLM_ATTENTION_BACKEND" not in engine.env:
        return
    version = _version(engine.version)
    if version is not None and version < VLLM_ATTENTION_ENV_REMOVED:
        return
    shown = f"vLLM {engine.version}" if engine.version else "vLLM of an unstated version"
    value = engine.env["VLLM_ATTENTION_BACKEND"]
    yield (
        setting_path(topo, engine.name, "env", "VLLM_ATTENTION_BACKEND"),
        f"{shown} no longer reads VLLM_ATTENTION_BACKEND (deprecated by vLLM PR 26315, gone "
        f"from {_show_version(VLLM_ATTENTION_ENV_REMOVED)}; 0.26.0 ignores it silently, vLLM "
        f"issue 50292), so the engine picks its own backend; set args.attention_backend: "
        f"{value} instead (seed 002 still used the variable, on vLLM 0.13.0)",
    )


# -- tokenizer -----------------------------------------------------------------------------------

# DeepSeek models whose chat encoding vLLM implements as a tokenizer mode of its own: the mode,
# and how the model's name (or its config.json model_type) spells the family.
DEEPSEEK_TOKENIZER_MODES = (
    ("deepseek_v32", "DeepSeek V3.2", re.compile(r"deepseek[-_ ]?v3[._-]?2(?![0-9])", re.I)),
    ("deepseek_v4", "DeepSeek V4", re.compile(r"deepseek[-_ ]?v4(?![0-9])", re.I)),
)
_TOKENIZER_EVIDENCE = {
    "deepseek_v32": "seed 002: all 10 vLLM commands for DeepSeek-V3.2 (vLLM 0.13.0, 8 x H200) "
    "pass --tokenizer-mode deepseek_v32",
    "deepseek_v4": "seed 003 §2.2: DeepSeek V4 'requires native engine support for the "
    "deepseek_v4 tokenizer', and every vLLM command there (§5, §9.2) passes --tokenizer-mode "
    "deepseek_v4",
}


def deepseek_tokenizer_mode(topo: Topology) -> tuple[str, str, str] | None:
    """(mode, family, where it was seen) when the model is DeepSeek V3.2 or V4, by its
    config.json model_type, else its name, served name or path."""
    try:
        facts = fit.model_facts(topo)
    except fit.ConfigError:
        facts = None  # model-config reports it
    model = topo.model
    names = [
        ("model.config model_type", facts.model_type if facts else ""),
        ("model.name", model.name),
        ("model.served_name", model.served_name),
        ("model.path", model.path.rstrip("/").rsplit("/", 1)[-1]),
    ]
    for where, text in names:
        for mode, family, pattern in DEEPSEEK_TOKENIZER_MODES:
            if text and pattern.search(text):
                return mode, family, f"{where} {text}"
    return None


@engine_rule(
    "tokenizer-mode",
    "warning",
    "vLLM serving DeepSeek V3.2 / V4 sets tokenizer_mode deepseek_v32 / deepseek_v4.",
    engine="vllm",
)
def tokenizer_mode(topo: Topology, engine: Engine) -> Iterator[Finding]:
    found = deepseek_tokenizer_mode(topo)
    if found is None:
        return
    mode, family, seen = found
    written = engine.args.get("tokenizer_mode")
    if written == mode:
        return
    now = (
        f"tokenizer_mode {written}"
        if written is not None
        else "no tokenizer_mode (vLLM's 'auto': the checkpoint's Hugging Face tokenizer)"
    )
    yield (
        setting_path(topo, engine.name, "args", "tokenizer_mode"),
        f"{engine.name} serves {family} ({seen}) on vLLM with {now}, not vLLM's "
        f"{mode} mode, which encodes the model's chat format; {_TOKENIZER_EVIDENCE[mode]}; set "
        f"args.tokenizer_mode: {mode}",
    )


# -- data parallel and experts -------------------------------------------------------------------


@engine_rule(
    "dp-nccl-sync",
    "warning",
    "vLLM DP with async scheduling syncs DP padding over NCCL, not the CPU.",
    engine="vllm",
    when=data_parallel,
)
def dp_nccl_sync(topo: Topology, engine: Engine) -> Iterator[Finding]:
    async_on = engine.args.get("async_scheduling")
    if async_on is False:
        return  # async-scheduling-dp covers dropping the async scheduler
    version = _version(engine.version)
    if async_on is None and version is not None and version < VLLM_ASYNC_DEFAULT:
        return  # async scheduling is off by default there
    if engine.args.get("disable_nccl_for_dp_synchronization") is False:
        return
    if "--no-disable-nccl-for-dp-synchronization" in engine.extra_args:
        return
    evidence = (
        "'DP Using CPU all reduce to synchronize DP padding between ranks' is logged and "
        "coordinate_batch_across_dp takes 9 ms instead of 1 ms per step (seeds 000/001 "
        "§4.4.1)"
    )
    if version is not None and version < VLLM_NCCL_DP_SYNC:
        yield (
            setting_path(topo, engine.name, "args", "async_scheduling"),
            f"dp {engine.dp} with async scheduling on vLLM {engine.version}: {evidence}; "
            f"this version lacks --no-disable-nccl-for-dp-synchronization (vLLM >= "
            f"{_show_version(VLLM_NCCL_DP_SYNC)}, PR 32197), so set async_scheduling: false "
            "or upgrade",
        )
        return
    yield (
        setting_path(topo, engine.name, "args", "disable_nccl_for_dp_synchronization"),
        f"dp {engine.dp} with async scheduling: {evidence}; set "
        "disable_nccl_for_dp_synchronization: false (--no-disable-nccl-for-dp-"
        "synchronization) to keep async scheduling and sync over NCCL",
    )


@engine_rule(
    "eplb-redundant-experts",
    "warning",
    "Multi-host EPLB has redundant experts (about one per GPU).",
)
def eplb_redundant_experts(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not engine.args.get("enable_eplb") or not engine.is_multi_node:
        return
    eplb = engine.args.get("eplb_config") or {}
    if eplb.get("num_redundant_experts"):
        return
    gpus = engine.gpu_count
    yield (
        setting_path(topo, engine.name, "args", "eplb_config"),
        f"EPLB across {len(engine.place)} hosts without redundant experts can only move "
        "experts, not replicate the hot ones; seed 001 §3.1 step 3: about one redundant "
        f"expert per GPU is best (more take HBM from the KV cache); set "
        f"eplb_config.num_redundant_experts: {gpus} ({gpus} GPUs)",
    )


# -- memory fit (hgxserve.topology.fit) ----------------------------------------------------------


def _fits(topo: Topology) -> dict[str, fit.EngineFit]:
    try:
        return fit.topology_fit(topo)[1]
    except fit.ConfigError:
        return {}  # model-config reports it


@rule(
    "model-config",
    "warning",
    "model.config names a readable config.json with the fields the fit estimate needs.",
)
def model_config(topo: Topology) -> Iterator[Finding]:
    try:
        fit.model_facts(topo)
    except fit.ConfigError as exc:
        yield (
            ("model", "config"),
            f"{exc}; without it there is no memory / KV-cache fit estimate (docs/fit.md)",
        )


@rule("fit-weights", "error", "The weights alone fit in each GPU's memory budget.")
def fit_weights(topo: Topology) -> Iterator[Finding]:
    for name, est in _fits(topo).items():
        if est.weights <= est.budget:
            continue
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


@rule(
    "fit-context",
    "error",
    "The KV cache holds at least one sequence of max_model_len tokens.",
)
def fit_context(topo: Topology) -> Iterator[Finding]:
    for name, est in _fits(topo).items():
        if est.weights > est.budget or not est.max_model_len:
            continue
        if est.kv_tokens >= est.max_model_len:
            continue
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


@rule(
    "fit-seed-oom",
    "warning",
    "No engine has a shape a seed saw run out of memory where the estimate says it fits.",
)
def fit_seed_oom(topo: Topology) -> Iterator[Finding]:
    for name, est in _fits(topo).items():
        if est.status != "seed-oom" or not est.max_model_len:
            continue
        need = est.max_model_len * est.kv_bytes_per_token
        yield (
            setting_path(topo, name, "args", "max_model_len"),
            f"{name}: max_model_len {est.max_model_len} with every attention head on each "
            f"GPU: {est.seed_failure}. The estimate leaves ~{fit.gib(est.kv_bytes)} GiB of KV "
            f"per GPU where one sequence needs ~{fit.gib(need)} and does not explain that "
            f"failure (docs/fit.md); set max_model_len <= {fit.SEED_DSA_TP1_WORKING_LEN} or "
            "split attention (tp 2 with dp 4 ran in LMCache PR 2521)",
        )


@rule(
    "fit-concurrency",
    "warning",
    "max_num_seqs and the warm-up concurrency fit in the estimated KV cache.",
)
def fit_concurrency(topo: Topology) -> Iterator[Finding]:
    for name, est in _fits(topo).items():
        if est.status == "no-fit" or not est.longest_shape:
            continue
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
                if (w.input, w.output, w.concurrency)
                == (shape.input, shape.output, shape.concurrency)
            )
            yield (
                ("warmup", index, "concurrency"),
                f"concurrency {shape.concurrency} of {shape.input}+{shape.output}-token "
                f"requests does not fit {name}'s KV cache: it holds {shape.capacity} such "
                f"sequences (~{est.kv_tokens} tokens x {est.dp_ranks} DP rank(s)), so the "
                "warm-up queues instead of compiling the shape it should (seed 003 §8.2); lower "
                "the concurrency or give the engine more KV memory",
            )


# -- runtime CUDA <-> driver ---------------------------------------------------------------------


@engine_rule(
    "runtime-driver",
    "warning",
    "A runtime's CUDA runs on the driver branch hgxserve installs (newer majors need newer).",
)
def runtime_driver(topo: Topology, engine: Engine) -> Iterator[Finding]:
    runtime = engine.runtime
    if runtime is None or not runtime.cuda:
        return
    why = cuda.cuda_driver_problem(runtime.cuda, driver_version=cuda.DRIVER_VERSION)
    if why is None:
        return
    branch = cuda.driver_branch_for(runtime.cuda)
    yield (
        setting_path(topo, engine.name, "runtime", "cuda"),
        f"{engine.name}'s runtime is built for CUDA {runtime.cuda}, and the driver hgxserve "
        f"installs by default is {cuda.DRIVER_VERSION}: {why}; the engine would fail at CUDA "
        f"init (seed 003 §12: SGLang v0.5.17 ran from a CUDA 13.0 image); provision the "
        f"hosts with --data driver_version=<a {branch} driver> (preflight checks the "
        "installed one), or use a runtime built for the installed CUDA",
    )
