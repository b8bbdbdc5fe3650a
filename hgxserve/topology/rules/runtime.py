"""Rules on engine runtimes: engine-runtime and runtime-*.

Every engine names its runtime (a venv or an image), and a runtime's CUDA runs on the driver
branch hgxserve installs.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology import cuda
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import Finding, engine_rule

FAMILY = ("engine-runtime", "runtime-")


@engine_rule(
    "engine-runtime",
    "error",
    "Every engine names its runtime (a venv or an image).",
    why=("without one nothing says which engine to run (the renderer refused it at deploy time)"),
)
def engine_runtime(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.runtime is None:
        yield (
            ("engines", engine.name),
            f"{engine.name} has no runtime: nothing says which {engine.engine} to run; set "
            "runtime: {venv: /opt/...} or {image: ...@sha256:...} here or in defaults",
        )


@engine_rule(
    "runtime-driver",
    "warning",
    "A runtime's CUDA runs on the driver branch hgxserve installs (newer majors need newer).",
    why=(
        "seed 003 §12: SGLang v0.5.17 in a CUDA 13.0 image needs branch 580; the default "
        "driver is 570 (`hgxserve/topology/cuda.py`)"
    ),
)
def runtime_driver(topo: Topology, engine: Engine) -> Iterator[Finding]:
    runtime = engine.runtime
    if runtime is None or not runtime.cuda:
        return
    why = cuda.cuda_driver_problem(runtime.cuda, driver_version=cuda.DRIVER_VERSION)
    if why is None:
        return
    branch = cuda.driver_branch_for(runtime.cuda)
    yield (
        setting_path(topo, engine.name, "runtime", "cuda"),
        f"{engine.name}'s runtime is built for CUDA {runtime.cuda}, and the driver hgxserve "
        f"installs by default is {cuda.DRIVER_VERSION}: {why}; the engine would fail at CUDA "
        f"init (seed 003 §12: SGLang v0.5.17 ran from a CUDA 13.0 image); provision the "
        f"hosts with --data driver_version=<a {branch} driver> (preflight checks the "
        "installed one), or use a runtime built for the installed CUDA",
    )
