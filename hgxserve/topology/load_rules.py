"""What a topology may make a host load: environment variables, engine flags, packages and
shipped files that run code inside the engine (as the user the engine runs as) are refused
unless the topology accepts each one by its path, with a reason (`accept:`), which `plan`
prints. Everything else a topology says is data.

    accept:
      "$.engines.decode-0.env.LD_PRELOAD": "jemalloc, reviewed by the platform team"

These are the rules whose errors an `accept:` entry may lift, one finding at a time
(`ITEM_ACCEPTABLE`); no other error can be accepted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from hgxserve.topology.kernels import KERNELS
from hgxserve.topology.model import Engine, Topology, normalize_dist
from hgxserve.topology.ports import setting_path
from hgxserve.topology.problems import JsonPath
from hgxserve.topology.registry import Finding, engine_rule, rule

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
# Read by the dynamic loader, an interpreter or a shell: each names code to run.
LOADER_PREFIXES = ("LD_", "PYTHON", "PERL5", "RUBY", "DYLD_")
LOADER_NAMES = frozenset(
    {"BASH_ENV", "ENV", "PATH", "GCONV_PATH", "GLIBC_TUNABLES", "NODE_OPTIONS",
     "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "IFS", "SHELLOPTS", "PS4", "HOSTALIASES",
     # in the families, yet each names a library or directory of plugins to load
     "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_ENV_PLUGIN",
     "UCX_MODULE_DIR", "NIXL_PLUGIN_DIR", "CUDA_INJECTION64_PATH"}
)  # fmt: skip
# Python's own variables that change no code that runs
PYTHON_HARMLESS = frozenset(
    {"PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
     "PYTHONIOENCODING", "PYTHONUTF8"}
)  # fmt: skip
# Engine flags whose value is code to import (a class or module path) or that let requests
# carry code (SGLang's custom logit processors arrive serialized in the request).
CODE_FLAGS = {
    "--worker-extension-cls": "imports the named class into every worker",
    "--worker-cls": "imports the named worker class",
    "--scheduler-cls": "imports the named scheduler class",
    "--logits-processors": "imports the named logits processor classes",
    "--middleware": "imports the named ASGI middleware into the API server",
    "--tool-parser-plugin": "executes the named Python file",
    "--reasoning-parser-plugin": "executes the named Python file",
    "--enable-custom-logit-processor": "runs logit processors that requests send serialized",
    "--custom-weight-loader": "imports the named weight loader functions",
}
# Packages a runtime may add without an accept: the kernels hgxserve knows (their preflight
# imports them) and the P/D transfer extras (hgxserve.runtime.spec.KV_EXTRAS).
KV_EXTRA_DISTS = ("nixl", "mooncake-transfer-engine")
ITEM_ACCEPTABLE = ("env-loads-code", "env-family", "args-load-code", "package-known",
                   "file-source-place")  # fmt: skip


def _accept_hint(path: JsonPath) -> str:
    from hgxserve.topology.problems import format_path

    return f"to keep it, accept it with a reason: accept: {{{format_path(path)!r}: why}}"


def loads_code(name: str) -> bool:
    """True for an environment variable that names code for the loader, an interpreter, a
    shell or a library to load."""
    if name in LOADER_NAMES:
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
            yield path, f"{name} {why}; {_accept_hint(path)}"


def _outside_families(name: str) -> bool:
    return not (loads_code(name) or name.startswith(ENV_FAMILIES) or name in PYTHON_HARMLESS)


@engine_rule(
    "env-loads-code",
    "error",
    "No env variable that makes the loader, an interpreter or a library load code, unless "
    "accepted by its path.",
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
)
def env_family(topo: Topology, engine: Engine) -> Iterator[Finding]:
    yield from _env_findings(
        topo, engine, _outside_families,
        f"is not a variable of the engines' families ({', '.join(ENV_FAMILIES[:8])}, ...)",
    )  # fmt: skip


def _flag_paths(topo: Topology, engine: Engine) -> Iterator[tuple[JsonPath, str, str]]:
    """(path, flag, value) of each extra arg that names code, where the user wrote it."""
    args = list(engine.extra_args)
    inherited = len(topo.raw.get("defaults", {}).get("extra_args", []))
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in CODE_FLAGS:
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        path: JsonPath = (
            ("defaults", "extra_args", i)
            if i < inherited
            else ("engines", engine.name, "extra_args", i - inherited)
        )
        yield path, flag, value


@engine_rule(
    "args-load-code",
    "error",
    "No engine flag that imports code the topology names (--worker-extension-cls, "
    "--middleware, ...), unless accepted by its path.",
)
def args_load_code(topo: Topology, engine: Engine) -> Iterator[Finding]:
    for path, flag, value in _flag_paths(topo, engine):
        what = f"{flag} {value}".strip()
        yield path, f"{what} {CODE_FLAGS[flag]}; {_accept_hint(path)}"


def _known_dists() -> set[str]:
    return {d for k in KERNELS.values() for d in k.dists} | set(KV_EXTRA_DISTS)


@engine_rule(
    "package-known",
    "error",
    "runtime.packages holds the kernels and transfer extras hgxserve knows; any other "
    "package is accepted by its path.",
)
def package_known(topo: Topology, engine: Engine) -> Iterator[Finding]:
    runtime = engine.runtime
    if runtime is None or not runtime.packages:
        return
    known = _known_dists()
    for i, pin in enumerate(runtime.packages):
        if normalize_dist(pin.split("==", 1)[0]) in known:
            continue
        path = _package_path(topo, engine, i)
        yield (
            path,
            f"{pin} is not a kernel or transfer package hgxserve knows ({', '.join(sorted(known))}"
            f"): its code runs in every engine process; {_accept_hint(path)}",
        )


def _package_path(topo: Topology, engine: Engine, index: int) -> JsonPath:
    base = setting_path(topo, engine.name, "runtime", "packages")
    return (*base, index) if base[-1] == "packages" else base


@rule(
    "file-source-place",
    "error",
    "files: sources lie in the topology's folder (or below it), unless accepted by path.",
)
def file_source_place(topo: Topology) -> Iterator[Finding]:
    folder = os.path.dirname(os.path.abspath(topo.source_file)) if topo.source_file else None
    if folder is None:
        return
    for name, spec in topo.files.items():
        if spec.is_url:
            continue  # pinned by sha256 and fetched by the controller
        real = os.path.realpath(spec.source)
        if os.path.commonpath([real, os.path.realpath(folder)]) == os.path.realpath(folder):
            continue
        path: JsonPath = ("files", name, "source")
        written = topo.raw.get("files", {}).get(name, {}).get("source", spec.source)
        yield (
            path,
            f"{written} lies outside the topology's folder: any file of the controller would "
            f"be shipped to the hosts (world-readable); {_accept_hint(path)}",
        )
