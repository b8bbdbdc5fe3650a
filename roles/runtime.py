"""Runtime role: put the engine (pinned vLLM / SGLang plus its P/D extras) into a venv on a host
with no internet access, from a wheelhouse the controller builds and pushes, or from a package
index / mirror the inventory names. Nothing happens when the venv already holds it.

Example:
    from hgxserve.deploy.plans import VenvPlan
    from hgxserve.runtime.spec import VenvRuntime
    from roles.runtime import runtime_venv
    runtime_venv(plan=VenvPlan(VenvRuntime("/opt/vllm-0.26", "vllm", "0.26.0"), build, None, None))
"""

from __future__ import annotations

import json
import os
import shlex
import urllib.parse
from dataclasses import dataclass, field

from pyinfra import host
from pyinfra.api import DeployError, deploy
from pyinfra.operations import files, server

from hgxserve.base.paths import AGENT, RUNTIME_STAGING
from hgxserve.deploy.plans import VenvPlan, WheelS3
from hgxserve.facts.runtime import DriverCuda, VenvRuntimeState
from hgxserve.operations.wheelhouse import push_wheelhouse
from hgxserve.runtime.checks import cuda_line
from hgxserve.runtime.spec import VenvRuntime, parse_pin, version_matches
from hgxserve.runtime.wheelhouse import LOCK_NAME, wheelhouse_lock_digest, wheelhouse_torch


def _quote(*words: str) -> str:
    return " ".join(shlex.quote(w) for w in words)


def installed_requirements(state: dict[str, object]) -> set[str]:
    """The pins the runtime stage recorded in the venv's marker (empty: none recorded)."""
    marker = state.get("marker")
    reqs = marker.get("requirements") if isinstance(marker, dict) else None
    return {str(r) for r in reqs} if isinstance(reqs, list) else set()


def installed_wheels(state: dict[str, object]) -> set[str]:
    """The sha256 of the wheels the runtime stage recorded in the venv's marker."""
    marker = state.get("marker")
    wheels = marker.get("wheels") if isinstance(marker, dict) else None
    return {str(w) for w in wheels} if isinstance(wheels, list) else set()


def runtime_current(spec: VenvRuntime, state: dict[str, object]) -> bool:
    """Whether the venv already holds `spec`: every pin recorded as installed (a venv shared by
    a baseline and a P/D topology holds both sets), the engine version, every import."""
    if not state.get("present") or state.get("error"):
        return False
    imports = state.get("imports")
    return (
        set(spec.requirements) <= installed_requirements(state)
        and {w.sha256 for w in spec.wheels} <= installed_wheels(state)
        and spec.version is not None
        and version_matches(spec.version, state.get("engine_version"))  # type: ignore[arg-type]
        and isinstance(imports, dict)
        and all(imports.get(m) == "ok" for m in spec.imports)
    )


@deploy("Install the engine runtime")
def runtime_venv(
    *, plan: VenvPlan, python: str = "python3", staging: str = RUNTIME_STAGING
) -> None:
    """Install `plan.spec` (engine==version and extras) into its venv; no-op when it is there.

    + plan: one venv of the runtime stage's plan (hgxserve.deploy.plans.VenvPlan):
      spec: the venv, engine, version, extras and modules that must import;
      wheelhouse: builds (once, on the controller) the wheelhouse tarball and its key; used
      unless `index_url` is given;
      index_url: a package index / mirror the host itself installs from (PEP 503 URL);
      planned_driver: the driver a provision stage of this run installs (for the CUDA check)
    + python: the host's Python used to create the venv
    + staging: host directory the wheelhouse is unpacked in (removed after installing)
    """
    spec = plan.spec
    state = host.get_fact(VenvRuntimeState, venv=spec.venv, dist=spec.dist, imports=spec.imports)
    if runtime_current(spec, state):
        host.noop(f"runtime {spec.venv} already holds {' '.join(spec.requirements)}")
        return
    found = state.get("engine_version")
    if found and spec.version and not version_matches(spec.version, found):
        raise DeployError(
            f"{host.name}: engine.version: expected {spec.engine} {spec.version} in {spec.venv}, "
            f"found {found} (a runtime venv is not changed in place; give it its own venv)"
        )
    venv, py = spec.venv.rstrip("/"), spec.python
    commands = [f"test -x {shlex.quote(py)} || {_quote(python, '-m', 'venv', venv)}"]
    source = _source(plan, staging)
    commands += source.before
    # binary wheels only: an sdist would run its build code as root on the host
    install = [f"{venv}/bin/pip", "install", "-q", "--disable-pip-version-check",
               "--no-cache-dir", "--only-binary=:all:", *source.args]  # fmt: skip
    cleanup = list(source.cleanup)
    commands.append(_quote(*install))
    if spec.wheels:
        wheel_commands, cleanup_wheels = _wheels(plan, staging)
        commands += wheel_commands
        cleanup = [*cleanup, cleanup_wheels]
    if spec.imports:
        check = "; ".join(f"import {m}" for m in spec.imports)
        commands.append(_quote(py, "-c", check))
    # pins installed earlier stay installed (pip only adds) unless this install re-pins them
    names = {parse_pin(r)[0].lower() for r in spec.requirements}
    earlier = {r for r in installed_requirements(state) if parse_pin(r)[0].lower() not in names}
    held = sorted(earlier | set(spec.requirements))
    record: dict[str, object] = {"requirements": held, "source": source.name}
    if source.lock:
        record["lock"] = source.lock
    wheels = sorted(installed_wheels(state) | {w.sha256 for w in spec.wheels})
    if wheels:
        record["wheels"] = wheels
    marker = json.dumps(record, sort_keys=True)
    commands.append(
        f"printf '%s\\n' {shlex.quote(marker)} > {shlex.quote(spec.marker + '.tmp')} && "
        f"mv {shlex.quote(spec.marker + '.tmp')} {shlex.quote(spec.marker)}"
    )
    commands += cleanup
    server.shell(
        name=f"Install {' '.join(spec.requirements)} into {spec.venv} from {source.name}",
        commands=commands,
    )


@dataclass(frozen=True)
class _Source:
    """Where a venv's packages come from: its name for the log and marker, the commands that
    bring it to the host, pip's arguments (with what to install), and the cleanup after."""

    name: str
    args: list[str]
    before: list[str] = field(default_factory=list)
    cleanup: list[str] = field(default_factory=list)
    lock: str | None = None  # sha256 of the wheelhouse's hash lock


def _source(plan: VenvPlan, staging: str) -> _Source:
    spec, index_url = plan.spec, plan.index_url
    if index_url:
        args = ["--index-url", index_url]
        if index_url.startswith("http://"):
            # a lab mirror without TLS: pip ignores it unless its host is named trusted (the
            # lock's hashes, not the transport, are what vouch for the files)
            args += ["--trusted-host", urllib.parse.urlsplit(index_url).netloc]
        lock = plan.index_lock
        if lock is None:  # runtime_index_unpinned=true: the plan said so on the controller
            return _Source(f"index {index_url}", [*args, *spec.requirements])
        # only what the lab's lock pins, each file by its sha256 (hgxserve.runtime.indexlock)
        dest = f"{staging.rstrip('/')}/index-{lock.sha256[:16]}.lock"
        files.put(
            name=f"Push the index lock {os.path.basename(lock.path)} for {spec.venv}",
            src=lock.path,
            dest=dest,
            mode="644",
            create_remote_dir=True,
        )
        return _Source(
            f"index {index_url}", [*args, "--require-hashes", "-r", dest],
            cleanup=[f"rm -f {shlex.quote(dest)}"], lock=lock.sha256,
        )  # fmt: skip
    tarball, key = plan.wheelhouse()
    torch = wheelhouse_torch(tarball)
    if torch:  # before anything is pushed: a CUDA this driver cannot run stops here
        line = cuda_line(
            host.name, spec.venv, *torch, host.get_fact(DriverCuda), plan.planned_driver
        )
        if line:
            raise DeployError(f"runtime wheelhouse {key}:\n  {line}")
    pushed = push_wheelhouse("runtime", tarball, key, staging)
    # exactly the wheels the controller downloaded, each by its sha256: the wheelhouse's lock
    # pins every transitive dependency too
    args = ["--no-index", "--find-links", pushed.path, "--require-hashes",
            "-r", f"{pushed.path}/{LOCK_NAME}"]  # fmt: skip
    return _Source(
        f"wheelhouse {key}", args, [pushed.unpack], [pushed.cleanup],
        wheelhouse_lock_digest(tarball),
    )  # fmt: skip


def _wheels(plan: VenvPlan, staging: str) -> tuple[list[str], str]:
    """Commands that bring `plan.spec.wheels` to `staging`/wheels (the agent fetches s3://
    urls; files are pushed now), check each sha256, and install them --no-deps --no-index."""
    spec, s3 = plan.spec, plan.s3 or WheelS3()
    where = f"{staging.rstrip('/')}/wheels"
    commands, paths = [f"mkdir -p {shlex.quote(where)}"], []
    for wheel in spec.wheels:
        dest = f"{where}/{wheel.filename}"
        paths.append(dest)
        if wheel.url:
            fetch = [AGENT, "runtime", "fetch-wheel", wheel.url, wheel.sha256, "--out", dest]
            if s3.env_file:
                fetch += ["--env-file", s3.env_file]
            if s3.endpoint:
                fetch += ["--endpoint-url", s3.endpoint]
            commands.append(shlex.join([*fetch, "--addressing", s3.addressing]))
        else:
            files.put(
                name=f"Push wheel {wheel.filename} for {spec.venv}",
                src=str(wheel.path),
                dest=dest,
                mode="644",
                create_remote_dir=True,
            )
        commands.append(f"echo {shlex.quote(wheel.sha256 + '  ' + dest)} | sha256sum -c --quiet")
    pip = f"{spec.venv.rstrip('/')}/bin/pip"
    commands.append(
        _quote(pip, "install", "-q", "--disable-pip-version-check", "--no-cache-dir",
               "--no-deps", "--no-index", *paths)
    )  # fmt: skip
    return commands, f"rm -rf {shlex.quote(where)}"
