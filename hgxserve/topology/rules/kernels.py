"""Rules on kernel packages: kernel-* (kernel-required, kernel-advised).

Both read the kernel extras table (hgxserve.topology.kernels): a venv runtime must hold each
kernel its model and args need, `kernel-required` where the engine fails without it,
`kernel-advised` where it runs a slower or fragile path.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.kernels import kernel_needs
from hgxserve.topology.model import Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.problems import Severity
from hgxserve.topology.registry import Finding, rule

FAMILY = ("kernel-",)


def _missing(topo: Topology, severity: Severity) -> Iterator[Finding]:
    for engine in topo.engines.values():
        runtime = engine.runtime
        if runtime is None or runtime.venv is None:
            continue  # an image (or the host's PATH) holds what it holds: preflight looks
        for need in kernel_needs(topo, engine):
            if need.declared or need.rule.severity != severity:
                continue
            kernel = need.kernel
            yield (
                setting_path(topo, engine.name, "runtime", "packages"),
                f"{engine.name} needs {kernel.name} ({' or '.join(kernel.dists)}) for "
                f"{need.reason}, and its runtime {runtime.venv} neither pins it in "
                "runtime.packages nor lists a wheel of it in runtime.wheels "
                f"({need.rule.evidence}); "
                f"add e.g. {kernel.example} to runtime.packages, or the in-house wheel to "
                "runtime.wheels with its sha256",
            )


@rule(
    "kernel-required",
    "error",
    "A venv runtime holds the kernels its model and args cannot start without (DeepEP, DeepGEMM).",
    why=(
        "deepep_* all-to-all backends import deep_ep at start-up (seed 001 §3.1 step 4); "
        "seed 002: SGLang could not start DeepSeek-V3.2 without DeepGEMM"
    ),
)
def kernel_required(topo: Topology) -> Iterator[Finding]:
    yield from _missing(topo, "error")


@rule(
    "kernel-advised",
    "warning",
    "A venv runtime holds the kernels its model and args run best on (NVSHMEM, DeepGEMM).",
    why=(
        "NVSHMEM for DeepEP's internode kernels; DeepGEMM for block-FP8 / DSA models under "
        "vLLM (seed 002 ran vLLM with VLLM_USE_DEEP_GEMM=0: it starts, on slower FP8 "
        "kernels). The table: `hgxserve/topology/kernels.py`, docs/runtime.md"
    ),
)
def kernel_advised(topo: Topology) -> Iterator[Finding]:
    yield from _missing(topo, "warning")
