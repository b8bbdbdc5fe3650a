"""Typed engine args and the flags each engine takes for them: the one table.

The vLLM and SGLang renderers take every flag name from here, the `extra-args-typed` rule
refuses every flag listed here in `extra_args`, and an arg an engine has no flag for (`None`)
is named in that engine's unit as not rendered. A new typed arg is one schema property
(`$defs.engineArgs`) plus one row here; tests/render/test_arg_flags.py checks both agree and
that each engine's renderer writes the flag.

>>> ARG_FLAGS["max_model_len"].vllm, ARG_FLAGS["max_model_len"].sglang
('--max-model-len', '--context-length')
"""

from __future__ import annotations

from dataclasses import dataclass

from hgxserve.topology.model import EngineKind


@dataclass(frozen=True)
class ArgFlag:
    """The flag of one typed arg in each engine (None: that engine has none), and any other
    flags the renderer writes for it (the --no- form, SGLang's split speculative flags...)."""

    vllm: str | None
    sglang: str | None
    also: tuple[str, ...] = ()

    def flag(self, engine: EngineKind) -> str | None:
        return self.vllm if engine == "vllm" else self.sglang


ARG_FLAGS: dict[str, ArgFlag] = {
    "dtype": ArgFlag("--dtype", "--dtype"),
    "trust_remote_code": ArgFlag("--trust-remote-code", "--trust-remote-code"),
    "kv_cache_dtype": ArgFlag("--kv-cache-dtype", "--kv-cache-dtype"),
    "block_size": ArgFlag("--block-size", "--page-size"),
    "gpu_memory_utilization": ArgFlag("--gpu-memory-utilization", "--mem-fraction-static"),
    "max_model_len": ArgFlag("--max-model-len", "--context-length"),
    "max_num_seqs": ArgFlag("--max-num-seqs", "--max-running-requests"),
    "max_num_batched_tokens": ArgFlag("--max-num-batched-tokens", "--chunked-prefill-size"),
    "max_cudagraph_capture_size": ArgFlag("--max-cudagraph-capture-size", "--cuda-graph-max-bs"),
    "tokenizer_mode": ArgFlag("--tokenizer-mode", "--tokenizer-mode"),
    "tool_call_parser": ArgFlag("--tool-call-parser", "--tool-call-parser"),
    "enable_auto_tool_choice": ArgFlag("--enable-auto-tool-choice", None),
    "reasoning_parser": ArgFlag("--reasoning-parser", "--reasoning-parser"),
    "chat_template": ArgFlag("--chat-template", "--chat-template"),
    # vLLM: --enable-prefix-caching / --no-enable-prefix-caching; SGLang: only "off" has a flag
    "enable_prefix_caching": ArgFlag(
        "--enable-prefix-caching", "--disable-radix-cache", ("--no-enable-prefix-caching",)
    ),
    "enforce_eager": ArgFlag("--enforce-eager", "--disable-cuda-graph"),
    "speculative_config": ArgFlag(
        "--speculative-config",
        "--speculative-algorithm",
        (
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
        ),
    ),
    "attention_backend": ArgFlag("--attention-backend", "--attention-backend"),
    "distributed_executor_backend": ArgFlag("--distributed-executor-backend", None),
    "async_scheduling": ArgFlag("--async-scheduling", None, ("--no-async-scheduling",)),
    "disable_nccl_for_dp_synchronization": ArgFlag(
        "--disable-nccl-for-dp-synchronization",
        None,
        ("--no-disable-nccl-for-dp-synchronization",),
    ),
    "enable_eplb": ArgFlag("--enable-eplb", "--enable-eplb"),
    "eplb_config": ArgFlag("--eplb-config", "--ep-num-redundant-experts"),
    "all2all_backend": ArgFlag("--all2all-backend", "--moe-a2a-backend", ("--deepep-mode",)),
    "moe_runner_backend": ArgFlag(None, "--moe-runner-backend"),
    "enable_dp_attention": ArgFlag(None, "--enable-dp-attention"),
}


def flag(key: str, engine: EngineKind) -> str:
    """The flag `engine` takes for arg `key` (KeyError when it has none)."""
    name = ARG_FLAGS[key].flag(engine)
    if name is None:
        raise KeyError(f"{engine} has no flag for {key}")
    return name


def not_rendered(engine: EngineKind) -> frozenset[str]:
    """Args `engine` has no flag for."""
    return frozenset(k for k, f in ARG_FLAGS.items() if f.flag(engine) is None)


def arg_of_flag() -> dict[str, str]:
    """Every flag written for a typed arg -> the arg (for the extra-args rule)."""
    out: dict[str, str] = {}
    for key, f in ARG_FLAGS.items():
        for name in (f.vllm, f.sglang, *f.also):
            if name is not None:
                out[name] = key
    return out
