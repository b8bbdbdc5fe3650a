"""Typed engine args: the one table.

`EngineArgs` is the type of `Engine.args` (mypy checks each read of an arg) and, line by line,
the table of what each arg is: its type, the flag each engine takes for it, the form the
renderers write it in, and whether it changes what the engine compiles. The vLLM and SGLang
renderers take every flag name from here, the `extra-args-typed` rule refuses every flag listed
here in `extra_args`, an arg an engine has no flag for (`None`) is named in that engine's unit
as not rendered, and the cache key (hgxserve.caches.key) hashes exactly the args marked
`compiles=True`. A new typed arg is one schema property (`$defs.engineArgs`), one line here
and, unless it is a boolean, a sample value in tests/render/test_arg_flags.py's VALUES; those
tests check the schema and the table agree and that each engine's renderer writes the flag (one
the renderers place nowhere else is written by its form after the other typed args).

>>> ARG_FLAGS["max_model_len"].vllm, ARG_FLAGS["max_model_len"].sglang
('--max-model-len', '--context-length')
>>> ARG_FLAGS["max_model_len"].compiles, ARG_FLAGS["gpu_memory_utilization"].compiles
(True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypedDict, get_type_hints

# The engines hgxserve renders (the schema's engine enum; test_vocabularies keeps them equal).
EngineKind = Literal["vllm", "sglang"]
# How the renderers write an arg when nothing engine-specific is needed:
#   value     `--flag value`
#   switch    `--flag` when true, nothing when false
#   tristate  true `--flag`, false `--no-flag` (vLLM's BooleanOptionalAction), unset nothing
#   json      `--flag <compact JSON>`
RenderForm = Literal["value", "switch", "tristate", "json"]


@dataclass(frozen=True)
class ArgFlag:
    """One typed arg: the flag it has in each engine (None: that engine has none), any other
    flags the renderer writes for it (SGLang's split speculative flags...), the form it is
    rendered in, and whether it changes the kernels the engine compiles or the CUDA graphs it
    captures (then it is part of the cache key). `compiles` has no default: each arg states it."""

    vllm: str | None
    sglang: str | None
    also: tuple[str, ...] = ()
    form: RenderForm = "value"
    compiles: bool = field(kw_only=True)

    def flag(self, engine: EngineKind) -> str | None:
        return self.vllm if engine == "vllm" else self.sglang

    @property
    def flags(self) -> tuple[str, ...]:
        """Every flag the renderers write for the arg (a tristate's --no- form included)."""
        negated = (negated_flag(self.vllm),) if self.form == "tristate" and self.vllm else ()
        return tuple(f for f in (self.vllm, self.sglang, *self.also, *negated) if f is not None)


def negated_flag(name: str) -> str:
    """The false form of a tristate flag: --no-<name> (argparse BooleanOptionalAction)."""
    return "--no-" + name[2:]


# `args.eplb_config` ($defs.eplb); "async" is a keyword, hence the functional form.
EplbConfig = TypedDict(
    "EplbConfig",
    {
        "window_size": int,
        "step_interval": int,
        "num_redundant_experts": int,
        "log_balancedness": bool,
        "async": bool,
    },
    total=False,
)


class EngineArgs(TypedDict, total=False):
    """`args:` of an engine as the schema validated it: only the args written are present."""

    dtype: Annotated[
        Literal["auto", "bfloat16", "float16", "float32"],
        ArgFlag("--dtype", "--dtype", compiles=True),
    ]
    trust_remote_code: Annotated[
        bool,
        ArgFlag("--trust-remote-code", "--trust-remote-code", form="switch", compiles=True),
    ]
    kv_cache_dtype: Annotated[
        Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"],
        ArgFlag("--kv-cache-dtype", "--kv-cache-dtype", compiles=True),
    ]
    block_size: Annotated[int, ArgFlag("--block-size", "--page-size", compiles=True)]
    gpu_memory_utilization: Annotated[
        float, ArgFlag("--gpu-memory-utilization", "--mem-fraction-static", compiles=False)
    ]
    max_model_len: Annotated[int, ArgFlag("--max-model-len", "--context-length", compiles=True)]
    max_num_seqs: Annotated[int, ArgFlag("--max-num-seqs", "--max-running-requests", compiles=True)]
    max_num_batched_tokens: Annotated[
        int, ArgFlag("--max-num-batched-tokens", "--chunked-prefill-size", compiles=True)
    ]
    max_cudagraph_capture_size: Annotated[
        int, ArgFlag("--max-cudagraph-capture-size", "--cuda-graph-max-bs", compiles=True)
    ]
    tokenizer_mode: Annotated[str, ArgFlag("--tokenizer-mode", "--tokenizer-mode", compiles=True)]
    tool_call_parser: Annotated[
        str, ArgFlag("--tool-call-parser", "--tool-call-parser", compiles=False)
    ]
    enable_auto_tool_choice: Annotated[
        bool, ArgFlag("--enable-auto-tool-choice", None, form="switch", compiles=False)
    ]
    reasoning_parser: Annotated[
        str, ArgFlag("--reasoning-parser", "--reasoning-parser", compiles=False)
    ]
    chat_template: Annotated[str, ArgFlag("--chat-template", "--chat-template", compiles=False)]
    # vLLM: --enable-prefix-caching / --no-enable-prefix-caching; SGLang: only "off" has a flag
    enable_prefix_caching: Annotated[
        bool,
        ArgFlag(
            "--enable-prefix-caching", "--disable-radix-cache", form="tristate", compiles=False
        ),
    ]
    enforce_eager: Annotated[
        bool, ArgFlag("--enforce-eager", "--disable-cuda-graph", form="switch", compiles=True)
    ]
    speculative_config: Annotated[
        dict[str, Any],
        ArgFlag(
            "--speculative-config",
            "--speculative-algorithm",
            (
                "--speculative-num-steps",
                "--speculative-eagle-topk",
                "--speculative-num-draft-tokens",
            ),
            form="json",
            compiles=True,
        ),
    ]
    attention_backend: Annotated[
        str, ArgFlag("--attention-backend", "--attention-backend", compiles=True)
    ]
    distributed_executor_backend: Annotated[
        Literal["mp", "ray", "uni", "external_launcher"],
        ArgFlag("--distributed-executor-backend", None, compiles=False),
    ]
    async_scheduling: Annotated[
        bool, ArgFlag("--async-scheduling", None, form="tristate", compiles=False)
    ]
    disable_nccl_for_dp_synchronization: Annotated[
        bool,
        ArgFlag("--disable-nccl-for-dp-synchronization", None, form="tristate", compiles=False),
    ]
    enable_eplb: Annotated[
        bool, ArgFlag("--enable-eplb", "--enable-eplb", form="switch", compiles=True)
    ]
    eplb_config: Annotated[
        EplbConfig,
        ArgFlag("--eplb-config", "--ep-num-redundant-experts", form="json", compiles=True),
    ]
    all2all_backend: Annotated[
        str,
        ArgFlag("--all2all-backend", "--moe-a2a-backend", ("--deepep-mode",), compiles=True),
    ]
    moe_runner_backend: Annotated[str, ArgFlag(None, "--moe-runner-backend", compiles=True)]
    enable_dp_attention: Annotated[
        bool, ArgFlag(None, "--enable-dp-attention", form="switch", compiles=True)
    ]


def _table() -> dict[str, ArgFlag]:
    hints = get_type_hints(EngineArgs, include_extras=True)
    table: dict[str, ArgFlag] = {}
    for key, hint in hints.items():
        rows = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, ArgFlag)]
        if len(rows) != 1:
            raise TypeError(f"EngineArgs.{key}: annotate it with exactly one ArgFlag(...)")
        table[key] = rows[0]
    return table


# arg -> its row, in the order EngineArgs lists them
ARG_FLAGS: dict[str, ArgFlag] = _table()
# Args that change which kernels are compiled or which CUDA graphs are captured: the cache key.
COMPILE_ARGS: tuple[str, ...] = tuple(k for k, f in ARG_FLAGS.items() if f.compiles)


def arg_value(args: Mapping[str, object], key: str) -> object:
    """The value of arg `key` in `args` (EngineArgs) when the name is held in a variable, not
    written as a literal (mypy types a literal read), None when unset."""
    return args.get(key)


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
        for name in f.flags:
            out[name] = key
    return out
