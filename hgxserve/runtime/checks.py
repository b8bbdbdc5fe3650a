"""Preflight of engine runtimes: one `HOST: FACT: expected X, found Y` line per mismatch.

Pure: takes what `VenvRuntimeState` and `DriverCuda` read (hgxserve.facts.runtime) and the
`VenvRuntime`s the topology asks for. With `will_install` (the runtime stage runs later in the
same deploy) a missing venv, engine or extra is not a problem — that stage installs it — but a
venv holding another engine version still is: a venv is never changed in place, because the
release that runs now (and the one rollback returns to) starts from it.

Example:
    >>> spec = VenvRuntime("/opt/vllm-sim", "vllm", "0.27.0")
    >>> runtime_problems("hgx-a", [spec], {"/opt/vllm-sim": {"present": True,
    ...     "engine_version": "0.26.0+sim", "imports": {}}}, None)[0]  # doctest: +ELLIPSIS
    'hgx-a: engine.version: expected vllm 0.27.0 in /opt/vllm-sim, found 0.26.0+sim (...)'
"""

from __future__ import annotations

from typing import Any

from hgxserve.runtime.spec import VenvRuntime, version_matches
from hgxserve.topology.cuda import cuda_driver_problem, max_cuda_of_driver

# fact, expected, found
_Mismatch = tuple[str, str, str]


def runtime_problems(  # noqa: PLR0913 - public: roles/preflight.py passes the two keyword options
    host: str,
    specs: list[VenvRuntime],
    states: dict[str, dict[str, Any]],
    driver: dict[str, Any] | None,
    *,
    will_install: bool = False,
    planned_driver: str | None = None,
) -> list[str]:
    """Every runtime mismatch on `host` (see the module docstring).

    + specs: the venv runtimes the topology needs on this host
    + states: venv path -> VenvRuntimeState value
    + driver: DriverCuda value (None: not read)
    + will_install: the runtime stage runs later in this deploy
    + planned_driver: the driver version the provision stage of this deploy installs
    """
    problems: list[str] = []
    for spec in specs:
        state = states.get(spec.venv) or {"present": False}
        wanted = f"{spec.engine} {spec.version}" if spec.version else spec.engine
        unusable = _unusable(spec, state, wanted, will_install)
        found = unusable if unusable is not None else [
            *_engine_mismatch(spec, state, wanted, will_install),
            *_import_mismatches(spec, state, will_install),
        ]  # fmt: skip
        problems += [f"{host}: {fact}: expected {want}, found {got}" for fact, want, got in found]
        # torch's own answer; without torch in the venv, what the topology declares
        cuda = state.get("torch_cuda") or spec.cuda
        if unusable is None and cuda:
            line = cuda_line(
                host, spec.venv, state.get("torch_version"), str(cuda), driver, planned_driver
            )
            problems.extend([line] if line else [])
    return problems


def _unusable(
    spec: VenvRuntime, state: dict[str, Any], wanted: str, will_install: bool
) -> list[_Mismatch] | None:
    """What is wrong with a venv that is missing or has no working Python; None when it runs."""
    if not state.get("present"):
        if will_install:
            return []
        return [
            (
                f"runtime {spec.venv}",
                f"{wanted} installed",
                "no venv (install it with deploys/runtime.py)",
            )
        ]
    if state.get("error"):
        return [(f"runtime {spec.venv}", "a working Python", state["error"].splitlines()[-1])]
    return None


def _engine_mismatch(
    spec: VenvRuntime, state: dict[str, Any], wanted: str, will_install: bool
) -> list[_Mismatch]:
    found = state.get("engine_version")
    if found is None:
        return (
            []
            if will_install
            else [("engine.version", f"{wanted} in {spec.venv}", "not installed")]
        )
    if spec.version and not version_matches(spec.version, found):
        return [
            (
                "engine.version",
                f"{wanted} in {spec.venv}",
                f"{found} (a runtime venv is not changed in place: releases start from it; "
                f"install {spec.version} into its own runtime.venv)",
            )
        ]
    return []


def _import_mismatches(
    spec: VenvRuntime, state: dict[str, Any], will_install: bool
) -> list[_Mismatch]:
    """The modules the venv must import, and UCX when NIXL is among them."""
    found: list[_Mismatch] = []
    imports = state.get("imports") or {}
    for module in spec.imports:
        result = imports.get(module)
        if result == "ok" or (will_install and result != "ok"):
            continue
        why = spec.why.get(module, "")
        found.append(
            (
                f"runtime.{module.split('.')[0]}",
                f"{module} importable in {spec.venv}" + (f" ({why})" if why else ""),
                result or "not checked",
            )
        )
    needs_ucx = any(m.startswith("nixl") for m in spec.imports)
    nixl_there = all(imports.get(m) == "ok" for m in spec.imports if m.startswith("nixl"))
    if needs_ucx and nixl_there and not state.get("ucx"):
        found.append(
            ("runtime.ucx", f"UCX (libucp) for NIXL in {spec.venv} or on the system", "none")
        )
    return found


def cuda_line(  # noqa: PLR0913 - public: roles/runtime.py asks it for one venv the same way
    host: str,
    venv: str,
    torch_version: str | None,
    cuda: str,
    driver: dict[str, Any] | None,
    planned_driver: str | None = None,
) -> str | None:
    """The `HOST: runtime.cuda: ...` line when torch's CUDA is newer than the driver's major
    (the driver a provision stage of this run installs, else the DriverCuda fact); else None.

    >>> cuda_line("h", "/opt/v", "2.9.0+cu130", "13.0", {"status": "ok",
    ...     "driver_version": "570.158.01", "cuda_version": "12.8"})  # doctest: +ELLIPSIS
    'h: runtime.cuda: expected CUDA <= 12.8 (driver 570.158.01) in /opt/v, found torch ...'
    """
    current = driver or {}
    version: str | None
    top: str | None
    if planned_driver and planned_driver != current.get("driver_version"):
        version, top = planned_driver, max_cuda_of_driver(planned_driver)
        whose = f"driver {planned_driver}, which this deploy installs"
    elif current.get("status") == "ok":
        version, top = current.get("driver_version"), current.get("cuda_version")
        whose = f"driver {version}"
    else:
        return None
    reason = cuda_driver_problem(cuda, driver_cuda=top, driver_version=version)
    if reason is None:
        return None
    built = f"torch {torch_version}" if torch_version else "a runtime (runtime.cuda)"
    return (
        f"{host}: runtime.cuda: expected CUDA <= {top or '?'} ({whose}) in {venv}, "
        f"found {built} built for CUDA {cuda}: {reason.split(';')[0]}"
    )


def image_problems(
    host: str,
    images: list[tuple[str, str]],
    states: dict[str, dict[str, Any]],
    *,
    will_install: bool = False,
) -> list[str]:
    """Container images (image, tool) that are not loaded with their pinned digest.

    >>> image_problems("h", [("r/x@sha256:" + "a" * 64, "podman")], {})  # doctest: +ELLIPSIS
    ['h: runtime.podman: expected podman installed (to run r/x@sha256:aaa...), found none']
    """
    problems: list[str] = []
    if will_install:
        return problems
    for image, tool in images:
        state = states.get(image) or {}
        digest = image.rpartition("@")[2]
        if not state.get("tool"):
            problems.append(
                f"{host}: runtime.{tool}: expected {tool} installed (to run {image}), found none"
            )
        elif state.get("digest") != digest:
            problems.append(
                f"{host}: runtime.image: expected {image} loaded in {tool}, found "
                f"{state.get('digest') or 'not present'} (the runtime stage loads it before "
                "any switch)"
            )
    return problems
