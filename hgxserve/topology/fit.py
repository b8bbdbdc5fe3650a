"""Does the model fit? Weights per GPU, KV bytes per token, KV tokens, concurrent sequences.

An estimate from the model's `config.json` (`model.config` in the topology, a path relative to
the topology file) and the engine's settings, following how vLLM sizes its KV cache
(gpu_worker.py determine_available_memory):

    budget    = GPU total x gpu_memory_utilization              (per GPU)
    weights   = dense / attention-TP + embeddings / attention-TP + experts / expert shards
    allowance = shared workspace + max(forward, sampler step) + non-torch   (the profiled peak)
    KV bytes  = budget - weights - allowance                    (per GPU)
    KV tokens = KV bytes / KV bytes per token                   (per DP rank: TP ranks share it)
    sequences = KV tokens // (length rounded up to block_size)  (per DP rank, x dp per engine)

Each allowance term follows vLLM's source (allowance_terms; docs/fit.md names file and figure).
The CUDA context and CUDA graphs are outside the budget (the seeds' cards sit above
gpu_memory_utilization for that reason: seed 003 §1, ~93 GiB of 95.6 on an H20 at 0.88).
docs/fit.md compares the estimate with what the seeds' engines reported, and says where it does
not explain them (seed 002's TP1 x DP8 at 163840).

A config may carry an `hgxserve_fit` block for what `config.json` cannot say (a model whose
attention the formulas here do not cover): `weights` ({"experts": bytes, "dense": bytes}),
`kv_bytes_per_token` and `sources`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import warmup_targets

GIB = 1 << 30
MIB = 1 << 20
# Memory nvidia-smi reports per GPU (MiB), from the captured outputs in
# shared/fixtures/real (h200_nvidia-smi.txt, h20_1gpu-vm_nvidia-smi.txt,
# h20-3e_nvidia-smi.txt, h100_nvidia-smi.txt). H800 is the H100's 80 GB board. B200 has no
# capture here: its 180 GB spec figure (180e9 bytes) stands in, rounded down.
GPU_MEMORY_MIB = {
    "H20": 97871,
    "H20-3e": 143771,
    "H100": 81559,
    "H800": 81559,
    "H200": 143771,
    "B200": 171661,
}
# What vLLM multiplies by gpu_memory_utilization is the total torch.cuda.mem_get_info() reports:
# nvidia-smi's total less what the driver reserves. Measured on one H200 (driver 580, torch
# 2.11+cu130): 150109880320 bytes = nvidia-smi's 143771 MiB - 616 MiB. The other kinds have no
# such measurement here and use nvidia-smi's total (their captures show 454-700 MiB reserved).
GPU_USABLE_BYTES = {"H200": 150109880320}
# vLLM's default --gpu-memory-utilization. SGLang picks --mem-fraction-static itself when it is
# unset; the estimate then assumes the same figure and says so.
DEFAULT_UTILIZATION = 0.9
# vLLM's default --max-num-batched-tokens for the OpenAI server on >= 70 GiB GPUs, and its
# default --max-num-seqs there.
DEFAULT_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 1024
DEFAULT_BLOCK_SIZE = 16
# vllm/platforms/cuda.py: FlashMLA-sparse runs on 64-token blocks, FlashMLA on multiples of 64
MLA_BLOCK_SIZE = 64
# How vLLM sizes the KV cache (vllm/v1/worker/gpu_worker.py determine_available_memory and
# vllm/utils/mem_utils.py memory_profiling, 0.13 to 0.32): it snapshots the GPU after the CUDA
# context and NCCL are up, runs one dummy forward of max_num_batched_tokens and one dummy sampler
# step of max_num_seqs (gpu_model_runner.py profile_run), and gives the KV cache
#     total x gpu_memory_utilization - (weights + torch peak increase + non-torch increase).
# The CUDA context and NCCL's init-time buffers are in the snapshot, outside that budget; CUDA
# graphs are captured after the KV cache, outside it too in 0.13 (later versions subtract a
# profiled graph estimate, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS). The terms below model the
# profiled part.
#
# Non-torch memory (not from PyTorch's allocator), measured on one H200 (driver 580, CUDA 13.0,
# torch 2.11+cu130; docs/fit.md): the CUDA context 0.514 GiB, +0.155 GiB once cuBLAS has run,
# +0.545 GiB after NCCL init and one all_reduce (one rank; with 8 ranks NCCL's buffers grow, not
# measured). vLLM snapshots after the context and NCCL init, so the context is outside the budget;
# cuBLAS and NCCL's first-use buffers come after the snapshot, inside it. An engine on one GPU
# has no NCCL communicator.
CUDA_CONTEXT_GIB = 0.514
NON_TORCH_CUBLAS_GIB = 0.155
NON_TORCH_NCCL_GIB = 0.545
# vLLM's shared workspace (vllm/v1/worker/workspace.py) is one buffer grown to the largest
# request: the fused-MoE kernels' scratch, the DSA indexer's prefill keys and FlashMLA-sparse's
# bf16 prefill workspace share it, so the term is their maximum, not their sum.
# vllm/envs.py VLLM_FUSED_MOE_CHUNK_SIZE: the tokens one fused-MoE pass works through.
MOE_CHUNK_TOKENS = 16 * 1024
# DeepGEMM's grouped GEMM (FP8 block-quantised MoE; VLLM_USE_DEEP_GEMM=1 by default) aligns each
# expert's rows to the 128 block: deep_gemm_utils.py compute_aligned_M =
# round_up(M x topk + local_experts x (128 - 1), 128).
DEEPGEMM_BLOCK_M = 128
# DeepSeek sparse attention (deepseek_v2.py sparse_attn_indexer, indexer.py
# get_max_prefill_buffer_size): the profile reserves the indexer's gathered prefill keys,
# 40 x max_model_len rows of index_head_dim fp8 bytes + a 4-byte fp32 scale.
DSA_INDEXER_ROWS_PER_LEN = 40
# flashmla_sparse.py get_prefill_workspace_size: 5 x max_model_len bf16 latent rows of 576,
# reserved when the KV cache is fp8_ds_mla (kv_cache_dtype fp8).
DSA_SPARSE_ROWS_PER_LEN = 5
# The dummy sampler step (gpu_model_runner.py _dummy_sampler_run with top-k and top-p set;
# sampler.py; topk_topp_sampler.py apply_top_k_top_p, the PyTorch path vLLM uses unless
# VLLM_USE_FLASHINFER_SAMPLER=1): bytes per request and vocabulary entry alive at its peak:
# bf16 logits 2 + fp32 copy 4 + sorted values 4 + int64 sort indices 8 + top-k mask 1 + top-p
# probabilities 4 + top-p mask 1 + scattered result 4.
SAMPLER_BYTES_PER_VOCAB = 28
# Residual stream copies alive through a decoder layer in bf16 (deepseek_v2.py / llama.py
# decoder layer: hidden states, residual, the block's output and its all-reduced/combined copy).
RESIDUAL_COPIES = 4
# KV bytes per latent row: bf16 576 (512 latent + 64 rope); fp8 576; vLLM's fp8_ds_mla layout
# for sparse MLA 656 (512 fp8 + 4 fp32 scales + 64 bf16 rope).
FP8_DS_MLA_BYTES = 656
INDEXER_KEY_BYTES = 4  # fp32 scale per indexer key, next to index_head_dim fp8 bytes

# Seed 002 (vLLM 0.13, 8 x H200): DeepSeek-V3.2 with -tp 1 -dp 8 --enable-expert-parallel ran
# out of memory at the full 163840 context and ran at 81920; LMCache PR 2521 saw the same shape
# crash on H200 ("TP1 requires too much memory on each GPU"). The terms here leave ~21 GiB of KV
# for it where one 163840 sequence needs 12: the estimate does not explain the failure, so a DSA
# model with all heads on every GPU above 81920 tokens, on a GPU no larger than the H200, is
# marked with the seed's fact instead of `ok` (docs/fit.md, "What the estimate does not explain").
SEED_DSA_TP1_WORKING_LEN = 81920
SEED_DSA_TP1_GPU_MIB = 143771

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
_KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2}
_QUANT_BYTES = {"fp8": 1.0, "mxfp4": 0.53, "fp4": 0.53, "nvfp4": 0.56}


class ConfigError(ValueError):
    """The model config is missing, unreadable or lacks a field the estimate needs."""


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs from a model config."""

    source: str
    layers: int
    hidden: int
    vocab: int
    attention: str  # mha | gqa | mla | dsa | given (kv_bytes_per_token from hgxserve_fit)
    kv_heads: int
    head_dim: int
    latent: int  # MLA: kv_lora_rank + qk_rope_head_dim
    index_head_dim: int  # DSA indexer key size (0: none)
    dense_bytes: float  # attention, dense MLP, shared experts, routers
    embed_bytes: float  # embeddings and LM head
    expert_bytes: float  # routed experts
    expert_count: int
    moe_layers: int
    expert_bytes_each: float  # one routed expert in one layer
    experts_per_token: int
    moe_intermediate: int
    intermediate: int  # dense MLP width (0: none)
    dense_mlp_layers: int  # layers with a dense MLP instead of experts
    block_fp8: bool  # FP8 block quantisation: vLLM runs its MoE on DeepGEMM
    heads: int
    q_head_dim: int  # query width per head (MLA: qk_nope + qk_rope)
    absorbed_per_head: int  # MLA: kv_lora_rank x (qk_nope + v) bf16 elements per head and layer
    dtype_bytes: int
    max_position: int | None
    kv_bytes_given: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    model_type: str = ""  # config.json's model_type (deepseek_v32, deepseek_v4, llama, ...)


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        if default is not None and value is None:
            return default
        raise ConfigError(f"config field {key!r} is missing or not an integer")
    return value


def _weight_bytes(config: dict[str, Any], dtype_bytes: int) -> float:
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    return _QUANT_BYTES.get(method, float(dtype_bytes))


def _block_fp8(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() == "fp8" and bool(
        quant.get("weight_block_size")
    )


class _Attention(NamedTuple):
    """One layer's attention: its parameters and the shape of its KV."""

    params: int
    kind: str  # mha | gqa | mla | dsa
    q_head_dim: int
    latent: int = 0
    index_dim: int = 0
    absorbed: int = 0


def _attention(
    config: dict[str, Any], hidden: int, heads: int, kv_heads: int, head_dim: int
) -> _Attention:
    kv_lora = config.get("kv_lora_rank")
    if not kv_lora:
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        attn += heads * head_dim * hidden
        return _Attention(attn, "gqa" if kv_heads < heads else "mha", head_dim)
    rope = _int(config, "qk_rope_head_dim")
    nope = _int(config, "qk_nope_head_dim")
    v_dim = _int(config, "v_head_dim")
    q_lora = config.get("q_lora_rank")
    q = (
        (hidden * q_lora + q_lora * heads * (nope + rope))
        if q_lora
        else hidden * heads * (nope + rope)
    )
    attn = q + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim)
    attn += heads * v_dim * hidden
    attention = "mla"
    index_dim = 0
    if config.get("index_n_heads"):
        index_dim = _int(config, "index_head_dim")
        index_heads = _int(config, "index_n_heads")
        attn += (q_lora or hidden) * index_heads * index_dim + hidden * index_dim
        attn += hidden * index_heads
        attention = "dsa"
    return _Attention(
        attn, attention, nope + rope, kv_lora + rope, index_dim, kv_lora * (nope + v_dim)
    )


def facts_from_config(config: dict[str, Any], source: str = "") -> ModelFacts:
    """ModelFacts from a Hugging Face config.json (DeepSeek V3/V3.2 MLA MoE, or a dense model).

    A dense float32 model of 2 layers: 2 x (4 x 128^2 + 3 x 128 x 256) parameters x 4 bytes.

    >>> facts_from_config({"hidden_size": 128, "intermediate_size": 256,
    ...     "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
    ...     "vocab_size": 512, "torch_dtype": "float32"}).dense_bytes
    1310720.0
    """
    dtype_bytes = _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    fit = config.get("hgxserve_fit") or {}
    hidden = _int(config, "hidden_size")
    layers = _int(config, "num_hidden_layers")
    vocab = _int(config, "vocab_size")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", heads)
    head_dim = _int(config, "head_dim", hidden // heads)
    tied = bool(config.get("tie_word_embeddings", False))
    embed = vocab * hidden * (1 if tied else 2) * dtype_bytes
    wbytes = _weight_bytes(config, dtype_bytes)
    n_experts = _int(config, "n_routed_experts", 0) or _int(config, "num_local_experts", 0)
    first_dense = _int(config, "first_k_dense_replace", 0) if n_experts else layers
    moe_layers = layers - first_dense
    inter = _int(config, "intermediate_size", 0)
    moe_inter = _int(config, "moe_intermediate_size", inter)
    expert_each = 3 * hidden * moe_inter * wbytes
    att = _attention(config, hidden, heads, kv_heads, head_dim)
    dense = layers * att.params + first_dense * 3 * hidden * inter
    shared = _int(config, "n_shared_experts", 0)
    dense += moe_layers * shared * 3 * hidden * moe_inter
    dense_bytes = dense * wbytes + moe_layers * n_experts * hidden * dtype_bytes  # routers
    expert_bytes = moe_layers * n_experts * expert_each
    weights = fit.get("weights")
    if weights:
        dense_bytes = float(weights["dense"]) - embed
        expert_bytes = float(weights["experts"])
        expert_each = expert_bytes / max(1, moe_layers * n_experts)
    given = fit.get("kv_bytes_per_token")
    return ModelFacts(
        source=source,
        layers=layers,
        hidden=hidden,
        vocab=vocab,
        attention="given" if given else att.kind,
        kv_heads=kv_heads,
        head_dim=head_dim,
        latent=att.latent,
        index_head_dim=att.index_dim,
        dense_bytes=float(dense_bytes),
        embed_bytes=float(embed),
        expert_bytes=float(expert_bytes),
        expert_count=n_experts,
        moe_layers=moe_layers if n_experts else 0,
        expert_bytes_each=float(expert_each),
        experts_per_token=_int(config, "num_experts_per_tok", 0),
        moe_intermediate=moe_inter,
        intermediate=inter,
        dense_mlp_layers=first_dense if inter else 0,
        block_fp8=_block_fp8(config),
        heads=heads,
        q_head_dim=att.q_head_dim,
        absorbed_per_head=att.absorbed,
        dtype_bytes=dtype_bytes,
        max_position=config.get("max_position_embeddings"),
        kv_bytes_given=int(given) if given else None,
        sources=dict(fit.get("sources", {})),
        model_type=str(config.get("model_type", "")),
    )


def config_path(topo: Topology) -> Path | None:
    """Where `model.config` points (relative to the topology file), or None when unset."""
    written = topo.model.config
    if not written:
        return None
    path = Path(written)
    if not path.is_absolute():
        path = Path(topo.source_file).resolve().parent / path
    return path


@cache
def _load(path: str, mtime_ns: int) -> ModelFacts:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError("not UTF-8 text") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("not a JSON object")
    return facts_from_config(data, path)


def model_facts(topo: Topology) -> ModelFacts | None:
    """The model's facts from `model.config`; None when the topology names no config.

    Raises ConfigError when the file is missing, unreadable or incomplete.
    """
    path = config_path(topo)
    if path is None:
        return None
    try:
        mtime = path.stat().st_mtime_ns
        return _load(str(path), mtime)
    except OSError as exc:
        raise ConfigError(
            f"model config {topo.model.config} (next to the topology) cannot be read: "
            f"{exc.strerror}"
        ) from exc
    except ConfigError as exc:
        raise ConfigError(f"model config {topo.model.config}: {exc}") from exc


# -- per engine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeFit:
    input: int
    output: int
    concurrency: int
    capacity: int  # sequences of input+output tokens the engine's KV holds (all DP ranks)


@dataclass(frozen=True)
class EngineFit:
    """The estimate for one engine (bytes are per GPU unless named otherwise)."""

    engine: str
    gpu: str
    gpu_bytes: int
    utilization: float
    utilization_assumed: bool
    budget: float
    weights: float
    allowance: float
    kv_bytes: float
    kv_bytes_per_token: int
    block_size: int
    kv_tokens: int  # per DP rank (every TP rank of it holds its share of the same tokens)
    dp_ranks: int
    max_model_len: int | None
    max_concurrency: float | None  # sequences of max_model_len tokens, per DP rank
    max_num_seqs: int  # per DP rank
    shapes: tuple[ShapeFit, ...]  # the warm-up shapes that reach this engine
    longest_shape: int | None  # tokens of its longest warm-up shape
    longest_capacity: int | None  # sequences of that length one DP rank holds
    kv_fixed: bool  # KV size set by --kv-cache-memory-bytes
    terms: dict[str, float] = field(default_factory=dict)  # allowance_terms, bytes
    seed_failure: str | None = None  # a seed saw this shape fail where the estimate fits

    @property
    def status(self) -> str:
        """`no-fit` (weights, or one max_model_len sequence), `seed-oom` (the estimate fits
        but a seed saw the shape run out of memory), `tight` (max_num_seqs or a warm-up shape
        does not fit) or `ok`."""
        if self.weights > self.budget:
            return "no-fit"
        if self.max_model_len and self.kv_tokens < self.max_model_len:
            return "no-fit"
        if self.seed_failure:
            return "seed-oom"
        if any(s.concurrency > s.capacity for s in self.shapes):
            return "tight"
        if self.longest_capacity is not None and self.max_num_seqs > self.longest_capacity:
            return "tight"
        return "ok"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["shapes"] = [asdict(s) for s in self.shapes]
        data["status"] = self.status
        return data


def _attention_split(engine: Engine) -> int:
    """Ranks that split the attention weights and KV heads (tp, or tp/dp with DP attention)."""
    if engine.dp_attention and engine.dp > 0 and engine.tp % engine.dp == 0:
        return max(1, engine.tp // engine.dp)
    return max(1, engine.tp)


def _expert_shards(engine: Engine) -> int:
    if not engine.ep:
        return engine.tp
    # vLLM: EP size = tp x dp; SGLang: --ep-size is tp (DP attention ranks live inside tp)
    return engine.tp if engine.engine == "sglang" else engine.tp * engine.dp


def weights_per_gpu(
    facts: ModelFacts, engine: Engine, *, tp: int | None = None, ep: bool | None = None
) -> float:
    """Bytes of weights one GPU of the engine holds; with `tp`, on the same GPUs at that tp
    (the rest dp) with or without expert parallelism over all of them."""
    if tp is None:
        split, shards = _attention_split(engine), _expert_shards(engine)
    else:
        split = tp
        shards = engine.gpu_count if (engine.ep if ep is None else ep) else tp
    redundant = engine.redundant_experts
    experts = facts.expert_bytes + redundant * facts.moe_layers * facts.expert_bytes_each
    # vLLM's MLA keeps W_UK and W_UV of this rank's heads in bf16 next to the fp8 kv_b_proj
    absorbed = facts.layers * facts.absorbed_per_head * math.ceil(facts.heads / split) * 2
    return (facts.dense_bytes + facts.embed_bytes) / split + experts / shards + absorbed


def kv_bytes_per_token(facts: ModelFacts, engine: Engine) -> int:
    """KV cache bytes one token takes on one GPU of the engine."""
    if facts.kv_bytes_given:
        return facts.kv_bytes_given
    elem = _kv_elem(facts, engine)
    if facts.attention in ("mla", "dsa"):
        # the latent is not split by heads: every TP rank keeps the whole latent row
        row = facts.latent * elem
        if facts.attention == "dsa" and elem == 1:
            row = FP8_DS_MLA_BYTES
        if facts.index_head_dim:
            row += facts.index_head_dim + INDEXER_KEY_BYTES
        return facts.layers * row
    heads_here = max(1, math.ceil(facts.kv_heads / _attention_split(engine)))
    return 2 * facts.layers * heads_here * facts.head_dim * elem


def _kv_memory_override(engine: Engine) -> int | None:
    args = engine.extra_args
    for i, arg in enumerate(args):
        if arg == "--kv-cache-memory-bytes" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--kv-cache-memory-bytes="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return int(value)
        except ValueError:
            return None
    space = engine.env.get("VLLM_CPU_KVCACHE_SPACE")  # vLLM's CPU backend: KV size in GiB
    if space:
        try:
            return int(float(space) * GIB)
        except ValueError:
            return None
    return None


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _moe_workspace(facts: ModelFacts, engine: Engine, gathered: int) -> int:
    """Bytes of vLLM's fused-MoE scratch for one pass over `gathered` tokens (modular_kernel.py
    _allocate_buffers; deep_gemm_moe.py / fused_moe.py workspace_shapes, bf16)."""
    if not facts.experts_per_token:
        return 0
    # without EP every rank holds a tp slice of all experts; with EP whole experts, redundant
    # EPLB ones included, spread over the expert shards
    local = facts.expert_count
    if engine.ep:
        local = -(-(facts.expert_count + engine.redundant_experts) // _expert_shards(engine))
    # w13 is [local experts, N = 2 x intermediate, K = hidden]; without EP the intermediate is
    # split over tp, with EP every expert is whole on its rank
    n = 2 * facts.moe_intermediate // (1 if engine.ep else max(1, engine.tp))
    k = facts.hidden
    topk = facts.experts_per_token

    def rows(m: int) -> int:
        if facts.block_fp8:
            return _round_up(m * topk + local * (DEEPGEMM_BLOCK_M - 1), DEEPGEMM_BLOCK_M)
        return m * topk

    def total(m_full: int) -> int:
        chunk = min(m_full, MOE_CHUNK_TOKENS)
        ws13 = rows(chunk) * max(n // 2, k)
        ws2 = rows(chunk) * max(n, k)
        out = m_full * k
        if chunk == m_full and ws13 >= out:
            out = 0  # the output reuses workspace13
        return (ws13 + ws2 + out) * 2

    need = total(gathered)
    if _dp_ep(engine):
        # the profile forces the worst case of a full chunk: random routing under DP + EP
        # may not show it (modular_kernel.py, is_profile_run)
        need = max(need, total(MOE_CHUNK_TOKENS))
    return need


def _dp_ep(engine: Engine) -> bool:
    return engine.engine == "vllm" and engine.ep and engine.dp > 1


def _gathers(engine: Engine) -> bool:
    backend = engine.args.get("all2all_backend") or engine.env.get("VLLM_ALL2ALL_BACKEND")
    return str(backend or "allgather_reducescatter") in ("allgather_reducescatter", "naive")


def _max_len(facts: ModelFacts, engine: Engine) -> int:
    """The engine's context: max_model_len, else the model's (0 when neither is known)."""
    return int(engine.args.get("max_model_len") or facts.max_position or 0)


def utilization(engine: Engine) -> float:
    """The fraction of GPU memory the engine takes: gpu_memory_utilization, else the default."""
    return float(engine.args.get("gpu_memory_utilization", DEFAULT_UTILIZATION))


def _kv_elem(facts: ModelFacts, engine: Engine) -> int:
    kv_dtype = engine.args.get("kv_cache_dtype", "auto")
    elem = _KV_DTYPE_BYTES.get(kv_dtype)
    if elem is None:  # auto: the model's dtype (or the engine's --dtype)
        dtype = engine.args.get("dtype", "auto")
        elem = _DTYPE_BYTES.get(dtype, facts.dtype_bytes)
    return elem


def allowance_terms(facts: ModelFacts, engine: Engine) -> dict[str, float]:
    """Bytes per GPU inside the budget besides weights and KV, term by term (docs/fit.md):

    `workspace` vLLM's shared workspace (the largest of `moe_workspace`, `dsa_indexer`,
    `dsa_sparse`), held from the profile on; `activations` the larger of `forward` and
    `sampler`, the transient peak on top of it; `non_torch` cuBLAS and NCCL (measured).
    `indexer_logits` (DSA) is not inside the profile and not in the total: the fp32 logits a
    prefill chunk of max_num_batched_tokens allocates against a max_model_len context.
    """
    tokens = int(engine.args.get("max_num_batched_tokens", DEFAULT_BATCHED_TOKENS))
    split = _attention_split(engine)
    hidden2 = facts.hidden * 2
    # vLLM DP + EP with the all-gather / reduce-scatter backend (vllm/envs.py
    # VLLM_ALL2ALL_BACKEND default): every DP rank's tokens reach the experts (fused_moe/layer.py
    # forward_impl, get_ep_group().dispatch). DeepEP / pplx send each rank only its routed tokens
    # (their own buffers are not modelled).
    gathered = tokens * engine.dp if _dp_ep(engine) and _gathers(engine) else tokens
    terms: dict[str, float] = {"moe_workspace": _moe_workspace(facts, engine, gathered)}
    length = _max_len(facts, engine)
    if facts.attention == "dsa":
        terms["dsa_indexer"] = (
            DSA_INDEXER_ROWS_PER_LEN * length * (facts.index_head_dim + INDEXER_KEY_BYTES)
        )
        if _kv_elem(facts, engine) == 1:  # fp8_ds_mla
            terms["dsa_sparse"] = DSA_SPARSE_ROWS_PER_LEN * length * facts.latent * 2
        terms["indexer_logits"] = tokens * length * 4
    terms["workspace"] = max(
        terms["moe_workspace"], terms.get("dsa_indexer", 0), terms.get("dsa_sparse", 0)
    )
    moe = 0
    if facts.experts_per_token:
        # gathered hidden states and router logits (bf16), one chunk's fp8 quantised input
        moe = gathered * (hidden2 + facts.expert_count * 2)
        moe += min(gathered, MOE_CHUNK_TOKENS) * facts.hidden
    dense = 0
    if facts.dense_mlp_layers:
        # gate_up output (2 x intermediate) and the activation (intermediate), bf16, split by tp
        dense = tokens * 3 * (facts.intermediate // max(1, engine.tp)) * 2
    attn = tokens * -(-facts.heads // split) * facts.q_head_dim * 2 * 2  # q and attention output
    terms["forward"] = RESIDUAL_COPIES * tokens * hidden2 + max(moe, dense, attn)
    seqs = min(_seqs_per_rank(engine), tokens)
    terms["sampler"] = seqs * facts.vocab * SAMPLER_BYTES_PER_VOCAB + tokens * hidden2
    terms["activations"] = max(terms["forward"], terms["sampler"])
    multi = engine.tp * engine.pp > 1 or engine.dp > 1
    terms["non_torch"] = (NON_TORCH_CUBLAS_GIB + (NON_TORCH_NCCL_GIB if multi else 0)) * GIB
    return terms


def _seqs_per_rank(engine: Engine) -> int:
    """max_num_seqs of one DP rank: vLLM's is per rank; SGLang's --max-running-requests is the
    engine's, shared by its DP attention ranks."""
    seqs = int(engine.args.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS))
    if engine.dp_attention and engine.dp > 1:
        return -(-seqs // engine.dp)
    return seqs


def _block_size(facts: ModelFacts, engine: Engine) -> int:
    """The KV block size: vLLM on CUDA forces 64 for FlashMLA-sparse (DSA) whatever is set, and
    a multiple of 64 for FlashMLA (MLA) (vllm/platforms/cuda.py check_and_update_config)."""
    block = int(engine.args.get("block_size", DEFAULT_BLOCK_SIZE))
    if engine.engine == "vllm" and facts.attention == "dsa":
        return MLA_BLOCK_SIZE
    if engine.engine == "vllm" and facts.attention == "mla" and block % MLA_BLOCK_SIZE:
        return MLA_BLOCK_SIZE
    return block


def _rounded(tokens: int, block: int) -> int:
    return math.ceil(tokens / block) * block


def engine_fit(topo: Topology, engine: Engine, facts: ModelFacts) -> EngineFit | None:
    """The estimate for one engine; None when its GPU kind has no known memory size."""
    gpus = [topo.hosts[h].gpu for h in engine.hosts if h in topo.hosts]
    if not gpus or gpus[0] not in GPU_MEMORY_MIB:
        return None
    gpu = gpus[0]
    gpu_bytes = GPU_USABLE_BYTES.get(gpu, GPU_MEMORY_MIB[gpu] * MIB)
    util = utilization(engine)
    budget = gpu_bytes * util
    weights = weights_per_gpu(facts, engine)
    terms = allowance_terms(facts, engine)
    other = terms["workspace"] + terms["activations"] + terms["non_torch"]
    # outside the budget: the CUDA context (in vLLM's snapshot), and what is left beside it for
    # CUDA graphs and buffers allocated at run time (not modelled)
    terms["context"] = CUDA_CONTEXT_GIB * GIB
    terms["headroom"] = max(0.0, gpu_bytes * (1 - util) - terms["context"])
    fixed = _kv_memory_override(engine)
    kv_bytes = float(fixed) if fixed is not None else max(0.0, budget - weights - other)
    per_token = kv_bytes_per_token(facts, engine)
    block = _block_size(facts, engine)
    kv_tokens = int(kv_bytes // per_token) // block * block
    max_len = _max_len(facts, engine) or None
    concurrency = kv_tokens / _rounded(max_len, block) if max_len else None
    dp_ranks = engine.dp
    shapes = tuple(
        ShapeFit(
            w.input,
            w.output,
            w.concurrency,
            dp_ranks * (kv_tokens // _rounded(w.input + w.output, block)),
        )
        for w in topo.warmup
        if engine.name in warmup_targets(topo, w)
    )
    longest = max((s.input + s.output for s in shapes), default=None)
    return EngineFit(
        engine=engine.name,
        gpu=gpu,
        gpu_bytes=gpu_bytes,
        utilization=util,
        utilization_assumed=engine.engine == "sglang"
        and "gpu_memory_utilization" not in engine.args,
        budget=budget,
        weights=weights,
        allowance=other,
        kv_bytes=kv_bytes,
        kv_bytes_per_token=per_token,
        block_size=block,
        kv_tokens=kv_tokens,
        dp_ranks=dp_ranks,
        max_model_len=max_len,
        max_concurrency=concurrency,
        max_num_seqs=_seqs_per_rank(engine),
        shapes=shapes,
        longest_shape=longest,
        longest_capacity=kv_tokens // _rounded(longest, block) if longest else None,
        kv_fixed=fixed is not None,
        terms=terms,
        seed_failure=_seed_failure(facts, engine, gpu_bytes, max_len),
    )


def _seed_failure(
    facts: ModelFacts, engine: Engine, gpu_bytes: int, max_len: int | None
) -> str | None:
    if not (
        facts.attention == "dsa"
        and engine.engine == "vllm"
        and _attention_split(engine) == 1
        and gpu_bytes <= SEED_DSA_TP1_GPU_MIB * MIB
        and max_len
        and max_len > SEED_DSA_TP1_WORKING_LEN
    ):
        return None
    return (
        "seed 002: DeepSeek-V3.2 with -tp 1 -dp 8 --enable-expert-parallel on 8 x H200 "
        f"(vLLM 0.13) ran out of memory at the full 163840 context and ran at "
        f"{SEED_DSA_TP1_WORKING_LEN}; LMCache PR 2521 saw the same shape crash ('TP1 requires "
        "too much memory on each GPU')"
    )


def topology_fit(topo: Topology) -> tuple[ModelFacts | None, dict[str, EngineFit]]:
    """Facts and per-engine estimates (empty without a model config; ConfigError if broken)."""
    facts = model_facts(topo)
    if facts is None:
        return None, {}
    fits = {}
    for engine in topo.engines.values():
        fit = engine_fit(topo, engine, facts)
        if fit is not None:
            fits[engine.name] = fit
    return facts, fits


def gib(value: float) -> str:
    """`93.1` for bytes in GiB, one decimal."""
    return f"{value / GIB:.1f}"
