"""Where JIT/compile caches live on a host: one pinned directory per cache key.

>>> cache_dir("/var/cache/hgxserve", "3f2a")
'/var/cache/hgxserve/3f2a'
>>> sorted(cache_env("/var/cache/hgxserve", "3f2a"))[:2]
['CUDA_CACHE_PATH', 'DG_JIT_CACHE_DIR']
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hgxserve.base.paths import CACHE_ROOT

DEFAULT_ROOT = CACHE_ROOT

# Sub-directory per JIT/compile cache kind (DESIGN.md "Host conventions").
SUBDIRS = ("vllm", "triton", "inductor", "deep_gemm", "flashinfer", "tilelang", "nv")

# Environment variable -> sub-directory that pins each engine/library cache inside the key dir,
# so nothing lands in $HOME or in /tmp (systemd PrivateTmp would throw it away).
ENV_SUBDIRS = {
    "VLLM_CACHE_ROOT": "vllm",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "SGLANG_DG_CACHE_DIR": "deep_gemm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TILELANG_CACHE_DIR": "tilelang",
    "CUDA_CACHE_PATH": "nv",
}

# Files hgxserve writes into a key directory. The restore marker is host-local state and never
# travels in an archive; the bake record does (it says what the cache was warmed with).
RESTORE_MARKER = ".hgxserve-cache.json"
BAKE_RECORD = ".hgxserve-bake.json"
MANIFEST_NAME = ".hgxserve-manifest.json"

# Bounds on what one cache archive may put on a host, checked before anything is written: a JIT
# cache of one engine is a few GiB (vLLM + DeepGEMM + Triton + inductor); these leave room.
MAX_RESTORE_BYTES = 64 << 30
MAX_RESTORE_ENTRIES = 500_000

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_key(key: str) -> bool:
    """True when `key` is usable as one directory name (no slashes, no dot-dot)."""
    return bool(_KEY_RE.match(key)) and ".." not in key


def cache_dir(root: str, key: str) -> str:
    """The pinned directory of one cache key."""
    if not valid_key(key):
        raise ValueError(f"not a cache key: {key!r}")
    return os.path.join(root, key)


def cache_env(root: str, key: str) -> dict[str, str]:
    """Environment that pins every JIT/compile cache of an engine under `<root>/<key>/`."""
    base = cache_dir(root, key)
    return {var: os.path.join(base, sub) for var, sub in ENV_SUBDIRS.items()}


def read_marker(dest: str) -> dict[str, Any] | None:
    """The restore marker of a key directory, or None when absent or unreadable."""
    try:
        with open(os.path.join(dest, RESTORE_MARKER)) as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
