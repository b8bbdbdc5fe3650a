"""Rules on engine environment variables: env-* (env-owned, env-loads-code, env-family).

env and secret_env do not set what the topology owns; no variable makes the loader, an
interpreter or a library load code, and every name belongs to the engines' own families,
unless `accept:` names the finding by its path (hgxserve.topology.rules.common).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hgxserve.base.cachelayout import ENV_SUBDIRS
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import Finding, engine_rule, rule
from hgxserve.topology.rules.common import accept_hint

FAMILY = ("env-",)


# Environment the renderer derives from the topology: an `env:` entry would silently replace it
# and defeat the rules that checked the topology's own value (GPU overlap, loopback side
# channels, port clashes, offline hosts, cache keys).
TOPOLOGY_OWNED_ENV = {
    "CUDA_VISIBLE_DEVICES": "the engine's place (GPU indices)",
    "VLLM_PORT": "internal_port",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "kv.side_channel.host",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "kv.side_channel.port",
    "UCX_NET_DEVICES": "kv.ucx_devices",
    "UCX_TLS": "kv.ucx_tls",
    "VLLM_RPC_BASE_PATH": "the engine's run directory",
    "TMPDIR": "the engine's run directory",
    "XDG_CACHE_HOME": "the engine's run directory",
    "HF_HOME": "the engine's run directory",
    "HF_HUB_OFFLINE": "hgxserve (hosts never download)",
    "TRANSFORMERS_OFFLINE": "hgxserve (hosts never download)",
    "VLLM_HOST_IP": "the host's address",
    **{var: "cache.root and the cache key" for var in ENV_SUBDIRS},
}


@rule(
    "env-owned",
    "error",
    "env and secret_env do not set what the topology owns (GPUs, ports, side channel, caches).",
    why=(
        "an env entry would replace the rendered value behind the GPU-overlap, loopback and "
        "port rules (docs/security.md)"
    ),
)
def env_owned(topo: Topology) -> Iterator[Finding]:
    places: list[tuple[tuple[str, ...], Any]] = [(("defaults",), topo.raw.get("defaults", {}))]
    places += [(("engines", n), d) for n, d in topo.raw.get("engines", {}).items()]
    for base, data in places:
        for section in ("env", "secret_env"):
            for key in (data or {}).get(section, {}) or {}:
                owner = TOPOLOGY_OWNED_ENV.get(key)
                if owner is not None:
                    yield (
                        (*base, section, key),
                        f"{key} is rendered from {owner}; remove this {section} entry (it "
                        "would replace the value the rules checked) and set that instead",
                    )


# Variable families of the engines and the libraries they load (vLLM, SGLang, PyTorch, NCCL,
# UCX, NIXL, Mooncake, CUDA, NVSHMEM, DeepGEMM / DeepEP, Triton, FlashInfer, Hugging Face,
# OpenMP / MKL): what the seeds and the engines' docs set.
ENV_FAMILIES = (
    "VLLM_", "SGLANG_", "NCCL_", "UCX_", "NIXL_", "CUDA_", "TORCH_", "HF_", "SGL_", "MC_",
    "MOONCAKE_", "CUBLAS_", "CUDNN_", "NVSHMEM_", "NVIDIA_", "PYTORCH_", "TORCHINDUCTOR_",
    "TRITON_", "DG_", "DEEPEP_", "DEEP_EP_", "FLASHINFER_", "TRANSFORMERS_",
    "TOKENIZERS_", "TIKTOKEN_", "OMP_", "MKL_", "KMP_", "GLOO_", "TP_", "OUTLINES_",
    "XGRAMMAR_",
)  # fmt: skip
# Read by the dynamic loader, an interpreter or a shell: each names code to run (or, for the
# engines' own, opens a route that runs what a request names).
LOADER_PREFIXES = ("LD_", "PYTHON", "PERL5", "RUBY", "DYLD_")
LOADER_NAMES = frozenset(
    {"BASH_ENV", "ENV", "PATH", "GCONV_PATH", "GLIBC_TUNABLES", "NODE_OPTIONS",
     "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "IFS", "SHELLOPTS", "PS4", "HOSTALIASES",
     # in the families, yet each names a library or directory of plugins to load
     "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_ENV_PLUGIN",
     "UCX_MODULE_DIR", "NIXL_PLUGIN_DIR", "CUDA_INJECTION64_PATH",
     # a logging dictConfig file: its `()` keys construct any callable (module.factory)
     "VLLM_LOGGING_CONFIG_PATH", "SGLANG_LOGGING_CONFIG_PATH",
     # open routes or decoders that run what a request sends: vLLM's dev-mode endpoints
     # (/reset_prefix_cache, /sleep, /collective_rpc: a method call in every worker), pickle on
     # the engine's sockets, LoRA adapters loaded from a request's path
     "VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_INSECURE_SERIALIZATION",
     "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
     # a library or binary the engine loads or runs instead of its own (vllm/envs.py)
     "VLLM_NCCL_SO_PATH", "VLLM_CUDART_SO_PATH", "VLLM_RUST_FRONTEND_PATH",
     "VLLM_CUDA_COMPATIBILITY_PATH", "SGLANG_TEST_SCRIPTED_RUNTIME_SYS_PATH_ENTRY"}
)  # fmt: skip
# name endings that name a library to load or a directory for sys.path, in any family
LOADER_SUFFIXES = ("_SO_PATH", "_SYS_PATH", "_SYS_PATH_ENTRY", "_PLUGIN_PATH", "_PLUGIN_DIR")
# Python's own variables that change no code that runs
PYTHON_HARMLESS = frozenset(
    {"PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
     "PYTHONIOENCODING", "PYTHONUTF8"}
)  # fmt: skip


def loads_code(name: str) -> bool:
    """True for an environment variable that names code for the loader, an interpreter, a
    shell or a library to load."""
    if name in LOADER_NAMES or name.endswith(LOADER_SUFFIXES):
        return True
    if name.startswith("PYTHON"):
        return name not in PYTHON_HARMLESS
    return name.startswith(LOADER_PREFIXES)


def _env_findings(
    topo: Topology, engine: Engine, select: Callable[[str], bool], why: str
) -> Iterator[Finding]:
    """One finding per env name of `engine` that `select` picks: `<name> <why>; accept hint`,
    at the path where the name is written (the engine or `defaults`)."""
    for name in sorted(engine.env):
        if select(name):
            path = setting_path(topo, engine.name, "env", name)
            yield path, f"{name} {why}; {accept_hint(path)}"


def _outside_families(name: str) -> bool:
    return not (loads_code(name) or name.startswith(ENV_FAMILIES) or name in PYTHON_HARMLESS)


@engine_rule(
    "env-loads-code",
    "error",
    "No env variable that makes the loader, an interpreter or a library load code, unless "
    "accepted by its path.",
    why=(
        "LD_PRELOAD, PYTHONPATH or NCCL_NET_PLUGIN run code the topology names inside every "
        "engine process, as the engine's user: a topology would be code execution on the GPU "
        "hosts"
    ),
)
def env_loads_code(topo: Topology, engine: Engine) -> Iterator[Finding]:
    yield from _env_findings(
        topo, engine, loads_code,
        "makes the engine's process load code the topology names (the dynamic loader, Python "
        "or a library reads it)",
    )  # fmt: skip


@engine_rule(
    "env-family",
    "error",
    "env names belong to the engines' own families (VLLM_, SGLANG_, NCCL_, UCX_, NIXL_, "
    "CUDA_, ...), unless accepted by its path.",
    why=(
        "a variable outside the engines' families changes something nobody reviewed for this "
        "engine (a shell, a loader, another program's config)"
    ),
)
def env_family(topo: Topology, engine: Engine) -> Iterator[Finding]:
    yield from _env_findings(
        topo, engine, _outside_families,
        f"is not a variable of the engines' families ({', '.join(ENV_FAMILIES[:8])}, ...)",
    )  # fmt: skip
