"""Rules that check vLLM engines only: vllm-*, and attention-backend, dcp-sparse, tokenizer-mode,
dp-nccl-sync, async-scheduling-dp, mtp-pd-version, ray-single-node.

Settings that failed a start or slowed an engine in the seeds: attention backends the model's
attention cannot use, decode context parallel with sparse FlashMLA, the removed
VLLM_ATTENTION_BACKEND variable, the DeepSeek tokenizer modes, DP padding synchronised over the
CPU, MTP with P/D before the fix, ray on one host. Each message carries the seed's evidence.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from hgxserve.topology import fit
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import Finding, data_parallel, engine_rule, sparse_attention
from hgxserve.topology.rules.common import HOPPER, at_least, gpu_kinds, older_than, show_version

FAMILY = (
    "vllm-",
    "attention-backend",
    "dcp-sparse",
    "tokenizer-mode",
    "dp-nccl-sync",
    "async-scheduling-dp",
    "mtp-pd-version",
    "ray-single-node",
)


# First vLLM release that certainly carries PR 32197 (--[no-]disable-nccl-for-dp-synchronization
# with async scheduling) and PR 32175 (MTP + P/D padding fix); both merged in January 2026.
VLLM_NCCL_DP_SYNC = (0, 15, 0)
VLLM_MTP_PD_FIX = (0, 15, 0)


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
    why=(
        "seed 002: CUTLASS_MLA, FLASHMLA, TRITON_MLA refused with 'sparse not supported' for "
        "DeepSeek-V3.2"
    ),
)
def attention_backend(topo: Topology, engine: Engine) -> Iterator[Finding]:
    attention = topo.model.architecture.attention
    if attention is None:
        return
    kinds = gpu_kinds(topo, engine)
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
    why="seed 002: `-dcp 8` fails with FlashMLA-sparse (vLLM issue 27544)",
)
def dcp_sparse(topo: Topology, engine: Engine) -> Iterator[Finding]:
    value = engine.extra_arg(*_DCP_FLAGS)
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
    "vllm-attention-backend-env",
    "error",
    "No VLLM_ATTENTION_BACKEND env on vLLM >= 0.14 (ignored); use args.attention_backend.",
    engine="vllm",
    why="deprecated by vLLM PR 26315; 0.26.0 ignores it silently (vLLM issue 50292)",
)
def vllm_attention_backend_env(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if "VLLM_ATTENTION_BACKEND" not in engine.env:
        return
    if older_than(engine, VLLM_ATTENTION_ENV_REMOVED):
        return
    shown = f"vLLM {engine.version}" if engine.version else "vLLM of an unstated version"
    value = engine.env["VLLM_ATTENTION_BACKEND"]
    yield (
        setting_path(topo, engine.name, "env", "VLLM_ATTENTION_BACKEND"),
        f"{shown} no longer reads VLLM_ATTENTION_BACKEND (deprecated by vLLM PR 26315, gone "
        f"from {show_version(VLLM_ATTENTION_ENV_REMOVED)}; 0.26.0 ignores it silently, vLLM "
        f"issue 50292), so the engine picks its own backend; set args.attention_backend: "
        f"{value} instead (seed 002 still used the variable, on vLLM 0.13.0)",
    )


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
    why=(
        "seed 002: all 10 vLLM commands for DeepSeek-V3.2 pass --tokenizer-mode "
        "deepseek_v32; seed 003 §2.2: V4 needs the engine's deepseek_v4 tokenizer (§5, §9.2 "
        "pass it). Without it vLLM falls back to the checkpoint's Hugging Face tokenizer and "
        "not the model's chat encoding; a warning, since neither seed shows vLLM refusing to "
        "start. The family is read from model.config's model_type, else the model's name, "
        "served name or path"
    ),
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


@engine_rule(
    "async-scheduling-dp",
    "warning",
    "Keep async scheduling with DP; use disable_nccl_for_dp_synchronization: false instead.",
    engine="vllm",
    when=data_parallel,
    why=(
        "seed 000 §3, §4.4.1: keep async scheduling, use --no-disable-nccl-for-dp-synchronization"
    ),
)
def async_scheduling_dp(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.args.get("async_scheduling") is not False:
        return
    if older_than(engine, VLLM_NCCL_DP_SYNC):
        return
    yield (
        setting_path(topo, engine.name, "args", "async_scheduling"),
        "async_scheduling: false (--no-async-scheduling) drops the async scheduler; on vLLM "
        f">= {show_version(VLLM_NCCL_DP_SYNC)} (PR 32197) keep it and set "
        "disable_nccl_for_dp_synchronization: false (--no-disable-nccl-for-dp-"
        "synchronization) so DP padding syncs over NCCL (seed 000 §4.4.1: 9 ms -> 1 ms in "
        "coordinate_batch_across_dp)",
    )


@engine_rule(
    "mtp-pd-version",
    "warning",
    "Speculative decoding with P/D needs vLLM with PR 32175.",
    engine="vllm",
    why="seed 000 §5.3.3: MTP + P/D crashed before vLLM PR 32175",
)
def mtp_pd_version(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.role not in ("prefill", "decode"):
        return
    if not engine.args.get("speculative_config"):
        return
    if at_least(engine, VLLM_MTP_PD_FIX):
        return
    shown = f"version {engine.version}" if engine.version else "an unstated version"
    yield (
        setting_path(topo, engine.name, "args", "speculative_config"),
        f"MTP/speculative decoding with P/D on vLLM {shown}: before PR 32175 requests "
        "without draft results broke padding (seed 000 §5.3.3: 'Invalid reshape for "
        "topk_indices', fp8_paged_mqa_logits batch size assertion); use vLLM >= "
        f"{show_version(VLLM_MTP_PD_FIX)} and set version",
    )


@engine_rule(
    "ray-single-node",
    "warning",
    "Single-host vLLM engines use the mp executor, not ray.",
    engine="vllm",
    why="seed 003 §11.3: garbage tokens with /health 200",
)
def ray_single_node(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.is_multi_node:
        return
    if engine.args.get("distributed_executor_backend") == "ray":
        yield (
            setting_path(topo, engine.name, "args", "distributed_executor_backend"),
            "the ray executor on a single-host engine produced garbage tokens (random "
            "Chinese/English and symbols) with /health 200 in seed 003 §11.3; use "
            "distributed_executor_backend: mp when the engine fits on one host",
        )


@engine_rule(
    "dp-nccl-sync",
    "warning",
    "vLLM DP with async scheduling syncs DP padding over NCCL, not the CPU.",
    engine="vllm",
    when=data_parallel,
    why=(
        "seeds 000/001 §4.4.1: 'DP Using CPU all reduce', 9 ms vs 1 ms per step; on vLLM < "
        "0.15 (no flag) turn async scheduling off"
    ),
)
def dp_nccl_sync(topo: Topology, engine: Engine) -> Iterator[Finding]:
    async_on = engine.args.get("async_scheduling")
    if async_on is False:
        return  # async-scheduling-dp covers dropping the async scheduler
    if async_on is None and older_than(engine, VLLM_ASYNC_DEFAULT):
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
    if older_than(engine, VLLM_NCCL_DP_SYNC):
        yield (
            setting_path(topo, engine.name, "args", "async_scheduling"),
            f"dp {engine.dp} with async scheduling on vLLM {engine.version}: {evidence}; "
            f"this version lacks --no-disable-nccl-for-dp-synchronization (vLLM >= "
            f"{show_version(VLLM_NCCL_DP_SYNC)}, PR 32197), so set async_scheduling: false "
            "or upgrade",
        )
        return
    yield (
        setting_path(topo, engine.name, "args", "disable_nccl_for_dp_synchronization"),
        f"dp {engine.dp} with async scheduling: {evidence}; set "
        "disable_nccl_for_dp_synchronization: false (--no-disable-nccl-for-dp-"
        "synchronization) to keep async scheduling and sync over NCCL",
    )
