"""The render-time cache key: which pinned JIT/compile cache directory an engine uses.

The key names `/var/cache/hgxserve/<key>/`. Two engines get the same key exactly when the
kernels they compile can be shared: same engine build, same runtime, same GPU kind, same model,
and the same settings that change what gets compiled. Prefill and decode with equal settings
share one key on purpose (their kernels are the same; only the KV connector differs).

What goes into the key (`key_inputs` returns it, so a test or an operator can see it):

- engine name and version, and the runtime (venv path, or the image digest)
- GPU kind of the engine's hosts (H20, H200, ...)
- model name, path and manifest name
- parallel layout: tp, dp, pp, ep
- the typed args in `COMPILE_ARGS`: those the args table (hgxserve.topology.engine_args) marks
  `compiles=True`
- every `extra_args` entry (their effect is unknown, so they count)
- `env` entries whose names start with one of `COMPILE_ENV_PREFIXES`
- host facts when given (driver, torch, CUDA, SM count ...): the caches issue adds them

Not in the key: ports, addresses, GPU indices, role, KV transfer settings, secrets, memory
fraction: none of them changes a compiled kernel.

>>> from hgxserve.topology import load_topology
>>> topo = load_topology("topologies/h20-v4flash-tp8.yml")  # doctest: +SKIP
>>> cache_key(topo, topo.engines["combined-0"])  # doctest: +SKIP
'vllm-0.26.0-h20-5d1f0c8e2a7b9c41'
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from hgxserve.topology.engine_args import COMPILE_ARGS, arg_value
from hgxserve.topology.model import Engine, Topology

# Engine env variables that can change compilation (kernel selection, JIT switches).
COMPILE_ENV_PREFIXES = (
    "VLLM_",
    "SGLANG_",
    "TORCH",
    "TRITON_",
    "DG_",
    "FLASHINFER_",
    "TILELANG_",
    "CUDA_",
    "NVTE_",
)

# Env that names places or ports, never what is compiled.
_IGNORED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_CACHE_PATH",
        "VLLM_PORT",
        "VLLM_HOST_IP",
        "VLLM_CACHE_ROOT",
        "VLLM_RPC_BASE_PATH",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_LOGGING_LEVEL",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "DG_JIT_CACHE_DIR",
        "SGLANG_DG_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        "TILELANG_CACHE_DIR",
    }
)

_UNSAFE = re.compile(r"[^a-z0-9.]+")


def key_inputs(
    topo: Topology, engine: Engine, host_facts: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything the key hashes, as one JSON-ready dict.

    >>> key_inputs(topo, topo.engines["decode-0"])["gpu"]  # doctest: +SKIP
    'H20'
    """
    runtime = engine.runtime
    gpu_kinds = sorted({topo.hosts[h].gpu for h in engine.place if h in topo.hosts})
    env = {
        k: v
        for k, v in sorted(engine.env.items())
        if k.startswith(COMPILE_ENV_PREFIXES) and k not in _IGNORED_ENV
    }
    return {
        "engine": engine.engine,
        "version": engine.version,
        "runtime": {
            "venv": runtime.venv if runtime else None,
            "image": runtime.image if runtime else None,
        },
        "gpu": ",".join(gpu_kinds),
        "model": {
            "name": topo.model.name,
            "path": topo.model.path,
            "manifest": topo.model.manifest,
        },
        "parallel": {"tp": engine.tp, "dp": engine.dp, "pp": engine.pp, "ep": engine.ep},
        "args": {k: arg_value(engine.args, k) for k in COMPILE_ARGS if k in engine.args},
        "extra_args": list(engine.extra_args),
        "env": env,
        "host_facts": dict(sorted((host_facts or {}).items())),
    }


def cache_key(topo: Topology, engine: Engine, host_facts: dict[str, Any] | None = None) -> str:
    """The cache key of one engine: a readable prefix and 16 hex digits of sha256.

    Stable: the same inputs give the same key in every process and on every machine.

    >>> cache_key(topo, topo.engines["decode-0"])  # doctest: +SKIP
    'vllm-0.26.0-h20-9b0f3c1d2e4a6b8c'
    """
    canon = json.dumps(
        key_inputs(topo, engine, host_facts), sort_keys=True, separators=(",", ":"), default=str
    )
    digest = hashlib.sha256(canon.encode()).hexdigest()[:16]
    prefix = "-".join(
        _UNSAFE.sub("-", part.lower()).strip("-")
        for part in (engine.engine, engine.version or "unversioned", _gpu_label(topo, engine))
    )
    return f"{prefix}-{digest}"


def _gpu_label(topo: Topology, engine: Engine) -> str:
    kinds = sorted({topo.hosts[h].gpu for h in engine.place if h in topo.hosts})
    return "+".join(kinds) or "gpu"
