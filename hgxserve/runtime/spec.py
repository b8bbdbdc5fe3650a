"""What a host's engine runtimes must hold, worked out from the topology (pure, no I/O).

One `VenvRuntime` per venv path on a host: the engine distribution pinned at the topology's
`version`, the extras its engines' P/D transfer needs (NIXL for vLLM's NixlConnector and for
SGLang's `nixl` backend, Mooncake's transfer engine for `mooncake`), any `runtime.packages` the
topology adds, the sha256-pinned `runtime.wheels` (kernels built in-house), and the modules that
must import (the extras' and the kernels hgxserve.topology.kernels says the engine needs).
Versions of the extras are pinned here, once.

    >>> spec = VenvRuntime("/opt/vllm-0.26", "vllm", "0.26.0", ("nixl==1.5.1",), ("nixl._api",))
    >>> spec.requirements
    ('vllm==0.26.0', 'nixl==1.5.1')
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

from hgxserve.base.paths import RUNTIME_MARKER
from hgxserve.topology.kernels import kernel_imports
from hgxserve.topology.model import Engine, RuntimeWheel, Topology

# The distribution each engine is installed as.
ENGINE_DIST = {"vllm": "vllm", "sglang": "sglang"}

# Extras that a KV transfer needs, per (engine, connector): pinned requirement, module to import,
# and why (the words preflight prints). nixl 1.5.1: the meta package vLLM imports as nixl._api
# (nixl-cu12 alone lacks it: "NIXL is not available"); it bundles UCX.
NIXL = ("nixl==1.5.1", "nixl._api")
MOONCAKE = ("mooncake-transfer-engine==0.3.13.post1", "mooncake.engine")
KV_EXTRAS: dict[tuple[str, str], tuple[tuple[str, str], str]] = {
    ("vllm", "nixl"): (NIXL, "vLLM P/D over NIXL"),
    ("sglang", "nixl"): (NIXL, "SGLang disaggregation over NIXL"),
    ("sglang", "mooncake"): (MOONCAKE, "SGLang disaggregation over Mooncake"),
    ("vllm", "mooncake"): (MOONCAKE, "vLLM P/D over Mooncake"),
}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


class RuntimeSpecError(ValueError):
    """A topology whose runtimes cannot be installed as written (one message per problem)."""


@dataclass(frozen=True)
class WheelFile:
    """One `runtime.wheels` entry: from S3 (`url`) or the controller (`path`, resolved)."""

    sha256: str
    filename: str
    url: str | None = None
    path: str | None = None


def wheel_file(wheel: RuntimeWheel, source_file: str = "") -> WheelFile:
    """The entry with its `file` resolved against the topology's folder.

    >>> wheel_file(RuntimeWheel("ab" * 32, file="w/x-1-py3-none-any.whl"), "/t/a.yml").path
    '/t/w/x-1-py3-none-any.whl'
    """
    path = None
    if wheel.file is not None:
        base = os.path.dirname(os.path.abspath(source_file)) if source_file else os.getcwd()
        path = os.path.join(base, wheel.file)
    return WheelFile(wheel.sha256, wheel.filename, url=wheel.url, path=path)


@dataclass(frozen=True)
class VenvRuntime:
    """One venv on one host: the engine at its version plus extras that must import."""

    venv: str
    engine: str
    version: str | None
    extras: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    why: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    cuda: str | None = None  # the topology's runtime.cuda, when it declares one
    wheels: tuple[WheelFile, ...] = ()  # installed after the requirements, --no-deps --no-index

    @property
    def dist(self) -> str:
        return ENGINE_DIST[self.engine]

    @property
    def requirements(self) -> tuple[str, ...]:
        """Exact pins, engine first: what `pip install` gets."""
        if self.version is None:
            raise RuntimeSpecError(f"runtime {self.venv}: no engine version to install")
        return (f"{self.dist}=={self.version}", *self.extras)

    @property
    def digest(self) -> str:
        """Names the venv's content: changes exactly when its requirements or wheels change."""
        text = "\n".join(sorted(self.requirements)) + "\n"
        if self.wheels:
            text += "".join(f"{w.sha256}\n" for w in sorted(self.wheels, key=lambda w: w.sha256))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def python(self) -> str:
        return f"{self.venv.rstrip('/')}/bin/python"

    @property
    def marker(self) -> str:
        """The file recording what the runtime stage installed (its digest and requirements)."""
        return f"{self.venv.rstrip('/')}/{RUNTIME_MARKER}"


def parse_pin(text: str) -> tuple[str, str]:
    """(name, version) of an exact `name==version` requirement; ValueError otherwise.

    >>> parse_pin("nixl==1.5.1")
    ('nixl', '1.5.1')
    """
    match = _PIN.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not an exact pin (name==version)")
    return match.group(1), match.group(2)


def version_matches(expected: str, found: str | None) -> bool:
    """Whether an installed version is the pinned one; a local label (`+cpu`, `+sim`) that the
    pin leaves out is ignored, as pip's `==` does.

    >>> version_matches("0.26.0", "0.26.0+sim"), version_matches("0.26.0", "0.26.1")
    (True, False)
    """
    if found is None:
        return False
    return found == expected or ("+" not in expected and found.split("+", 1)[0] == expected)


def _engine_extras(engine: Engine, topo: Topology) -> list[tuple[tuple[str, str], str]]:
    extras = []
    if engine.kv is not None:
        key = (engine.engine, engine.kv.connector)
        if key in KV_EXTRAS:
            extras.append(KV_EXTRAS[key])
    return extras


def _add_wheels(entry: dict[str, object], engine: Engine, topo: Topology) -> None:
    """Record the engine's `runtime.wheels` in the venv's entry, and their dists' kernels."""
    wheels: dict[str, WheelFile] = entry["wheels"]  # type: ignore[assignment]
    why: dict[str, str] = entry["why"]  # type: ignore[assignment]
    assert engine.runtime is not None
    for wheel in engine.runtime.wheels:
        wheels[wheel.sha256] = wheel_file(wheel, topo.source_file)
    for module, reason in kernel_imports(topo, engine):
        why.setdefault(module, reason)


def venv_runtimes(topo: Topology, host: str, require_version: bool = True) -> list[VenvRuntime]:
    """The venv runtimes `host` needs for its engines, one per venv path (sorted).

    Raises RuntimeSpecError listing every engine whose runtime cannot be installed: no
    `version` (unless `require_version=False`: preflight then only checks the engine is there),
    or two engines sharing a venv with different engines or versions.
    """
    problems: list[str] = []
    by_venv: dict[str, dict[str, object]] = {}
    for engine in topo.engines_on(host):
        runtime = engine.runtime
        if runtime is None or runtime.venv is None:
            continue
        if not engine.version and require_version:
            problems.append(
                f"engine {engine.name}: runtime.venv {runtime.venv} needs the engine `version` "
                f"to install (e.g. version: 0.26.0)"
            )
            continue
        entry = by_venv.setdefault(
            runtime.venv,
            {"engine": engine.engine, "version": engine.version, "by": engine.name,
             "extras": {}, "why": {}, "cuda": runtime.cuda, "wheels": {}},
        )  # fmt: skip
        if (entry["engine"], entry["version"]) != (engine.engine, engine.version):
            problems.append(
                f"engine {engine.name}: runtime.venv {runtime.venv} holds {entry['engine']} "
                f"{entry['version']} for {entry['by']}, not {engine.engine} {engine.version}; "
                "give each engine version its own venv"
            )
            continue
        extras: dict[str, str] = entry["extras"]  # type: ignore[assignment]
        why: dict[str, str] = entry["why"]  # type: ignore[assignment]
        for (pin, module), reason in _engine_extras(engine, topo):
            extras[parse_pin(pin)[0].lower()] = pin
            why.setdefault(module, reason)
        _add_wheels(entry, engine, topo)
        for pin in runtime.packages:
            name, _ = parse_pin(pin)
            if name.lower() == ENGINE_DIST[engine.engine]:
                problems.append(
                    f"engine {engine.name}: runtime.packages pins {pin}; the engine itself is "
                    "pinned by `version`"
                )
                continue
            extras[name.lower()] = pin
    if problems:
        raise RuntimeSpecError("\n".join(problems))
    out = []
    for venv, entry in sorted(by_venv.items()):
        extras = entry["extras"]  # type: ignore[assignment]
        why = entry["why"]  # type: ignore[assignment]
        wheels: dict[str, WheelFile] = entry["wheels"]  # type: ignore[assignment]
        out.append(
            VenvRuntime(
                venv=venv,
                engine=str(entry["engine"]),
                version=str(entry["version"]) if entry["version"] else None,
                extras=tuple(extras[k] for k in sorted(extras)),
                imports=tuple(sorted(why)),
                why=dict(why),
                cuda=str(entry["cuda"]) if entry["cuda"] else None,
                wheels=tuple(wheels[k] for k in sorted(wheels)),
            )
        )
    return out


def container_images(topo: Topology, host: str) -> list[tuple[str, str]]:
    """(image, tool) of every container runtime on `host`: its engines' and the proxy's."""
    runtimes = [engine.runtime for engine in topo.engines_on(host)]
    if topo.proxy is not None and topo.proxy.host == host:
        runtimes.append(topo.proxy.runtime)
    return sorted({(r.image, r.tool or "podman") for r in runtimes if r is not None and r.image})
