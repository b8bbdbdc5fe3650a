"""Kernel extras: which kernel packages a model and an engine's args need, in one table.

A row of `KERNEL_RULES` names a kernel of `KERNELS`, the engines it applies to, what in the
topology selects it (a `when` function that returns the reason, or None), and how bad its
absence from the engine's venv runtime (`runtime.packages` / `runtime.wheels`) is. Two
rules read the table (hgxserve.topology.rules.kernels): `kernel-required` (the engine fails
without it) and `kernel-advised` (a slower or fragile path). A kernel the engine's own wheel
carries (`bundled`) is never asked for, but preflight still imports its module
(hgxserve.runtime.spec adds every needed kernel's module to the venv's imports).

    >>> KERNELS["deepep"].module
    'deep_ep'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hgxserve.topology import fit
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.problems import Severity


@dataclass(frozen=True)
class Kernel:
    """A kernel package: its name, the distributions that provide it (PEP 503 normalised),
    the module preflight imports, and an example pin for the message."""

    name: str
    dists: tuple[str, ...]
    module: str
    example: str


# Versions of the examples: DeepGEMM v2.1.1 is the tag vLLM's DeepSeek-V3.2 recipe installs;
# DeepEP 1.2.1 its release of that time; nvidia-nvshmem-cu12 3.3.20 is the NVSHMEM torch 2.9
# (vLLM 0.15) pins.
KERNELS: dict[str, Kernel] = {
    "deepgemm": Kernel("DeepGEMM", ("deep-gemm",), "deep_gemm", "deep-gemm==2.1.1"),
    "deepep": Kernel("DeepEP", ("deep-ep",), "deep_ep", "deep-ep==1.2.1"),
    "nvshmem": Kernel(
        "NVSHMEM",
        ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"),
        "nvidia.nvshmem",
        "nvidia-nvshmem-cu12==3.3.20",
    ),
    "flashinfer": Kernel("FlashInfer", ("flashinfer-python",), "flashinfer", ""),
    # FlashMLA ships inside each engine's own kernels (vLLM's _flashmla_C, SGLang's sgl-kernel)
    "flashmla-vllm": Kernel("FlashMLA", (), "vllm._flashmla_C", ""),
    "flashmla-sglang": Kernel("FlashMLA", (), "sgl_kernel.flash_mla", ""),
}

Reason = Callable[[Topology, Engine], str | None]


@dataclass(frozen=True)
class KernelRule:
    kernel: str  # a key of KERNELS
    engines: tuple[str, ...]  # engine kinds the row applies to
    when: Reason  # what selects the kernel (None: not needed)
    severity: Severity
    evidence: str
    bundled: bool = False  # the engine's own distribution carries it: only preflight imports it


def _deepep(topo: Topology, engine: Engine) -> str | None:
    backend = engine.args.get("all2all_backend") or ""
    if backend.startswith("deepep"):
        return f"args.all2all_backend {backend}"
    return None


def _block_fp8(topo: Topology) -> bool:
    try:
        facts = fit.model_facts(topo)
    except fit.ConfigError:
        return False  # model-config reports it
    return bool(facts and facts.block_fp8)


def _dsa(topo: Topology, engine: Engine) -> str | None:
    if topo.model.architecture.attention == "dsa":
        return "the model's DSA attention (FP8 indexer and MLA paths on DeepGEMM)"
    return None


def _deepseek_fp8(topo: Topology, engine: Engine) -> str | None:
    if _block_fp8(topo):
        return "the model's block-FP8 weights (FP8 MoE / MLA GEMMs on DeepGEMM)"
    return _dsa(topo, engine)


_FLASHINFER_FLAGS = (
    "--attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
)
_FLASHMLA_FLAGS = (
    *_FLASHINFER_FLAGS,
    "--nsa-prefill-backend",
    "--nsa-decode-backend",
)


def _backend_selects(engine: Engine, word: str, flags: tuple[str, ...]) -> str | None:
    chosen = [("args.attention_backend", engine.args.get("attention_backend"))]
    chosen += [(f"extra_args {f}", engine.extra_arg(f)) for f in flags]
    for where, value in chosen:
        if value and word in str(value).lower():
            return f"{where} {value}"
    return None


def _flashinfer(topo: Topology, engine: Engine) -> str | None:
    return _backend_selects(engine, "flashinfer", _FLASHINFER_FLAGS)


def _flashmla(topo: Topology, engine: Engine) -> str | None:
    return _backend_selects(engine, "flashmla", _FLASHMLA_FLAGS)


KERNEL_RULES: tuple[KernelRule, ...] = (
    KernelRule(
        "deepep", ("vllm", "sglang"), _deepep, "error",
        "the deepep all-to-all backends import deep_ep at start-up (seed 001 §3.1 step 4: "
        "deepep_high_throughput for prefill, deepep_low_latency for decode across nodes)",
    ),
    KernelRule(
        "nvshmem", ("vllm", "sglang"), _deepep, "warning",
        "DeepEP's internode and low-latency kernels run on NVSHMEM (IBGDA across hosts)",
    ),
    KernelRule(
        "deepgemm", ("sglang",), _dsa, "error",
        "seed 002: with DeepGEMM disabled, SGLang could not start DeepSeek-V3.2",
    ),
    KernelRule(
        "deepgemm", ("vllm", "sglang"), _deepseek_fp8, "warning",
        "it starts without it (seed 002 ran vLLM with VLLM_USE_DEEP_GEMM=0) on slower "
        "CUTLASS / Triton FP8 kernels; seeds 000/001 warm DeepGEMM up",
    ),
    KernelRule(
        "flashinfer", ("vllm", "sglang"), _flashinfer, "warning",
        "the engine depends on flashinfer-python itself", bundled=True,
    ),
    KernelRule(
        "flashmla-vllm", ("vllm",), _flashmla, "warning",
        "vLLM builds FlashMLA into its wheel", bundled=True,
    ),
    KernelRule(
        "flashmla-sglang", ("sglang",), _flashmla, "warning",
        "SGLang's sgl-kernel carries FlashMLA", bundled=True,
    ),
)  # fmt: skip


@dataclass(frozen=True)
class KernelNeed:
    """One kernel an engine needs: the row, why (what selected it), and whether the engine's
    venv runtime declares a package or wheel that provides it."""

    rule: KernelRule
    kernel: Kernel
    reason: str
    declared: bool


def kernel_needs(topo: Topology, engine: Engine) -> list[KernelNeed]:
    """The kernels `engine` needs, by the table (one per kernel, the most severe row)."""
    runtime = engine.runtime
    provided = runtime.provides() if runtime is not None else set()
    needs: dict[str, KernelNeed] = {}
    for row in KERNEL_RULES:
        if engine.engine not in row.engines:
            continue
        reason = row.when(topo, engine)
        if reason is None:
            continue
        kernel = KERNELS[row.kernel]
        seen = needs.get(row.kernel)
        if seen is not None and seen.rule.severity == "error":
            continue
        declared = row.bundled or bool(provided & set(kernel.dists))
        needs[row.kernel] = KernelNeed(row, kernel, reason, declared)
    return list(needs.values())


def deepep_across_hosts(topo: Topology, host: str) -> list[str]:
    """The engines on `host` whose DeepEP all-to-all spans hosts: provision sets the nvidia
    module's IBGDA options there (roles/nvidia_driver.py, `ibgda=True`)."""
    return [e.name for e in topo.engines_on(host) if e.is_multi_node and _deepep(topo, e)]


def kernel_imports(topo: Topology, engine: Engine) -> list[tuple[str, str]]:
    """(module, why) preflight imports in the engine's venv: every needed kernel that the
    runtime declares or the engine carries (one it lacks is a validation finding instead)."""
    return [
        (need.kernel.module, f"{need.kernel.name} for {need.reason}")
        for need in kernel_needs(topo, engine)
        if need.declared
    ]
