"""Agent role: install hgxserve into /opt/hgxserve on a host with no internet access, from a
wheelhouse built on the controller for the host's own python3 (the host-side commands units and
deploys call)."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import DeployError, deploy
from pyinfra.facts.server import Command
from pyinfra.operations import server

from hgxserve.base.paths import AGENT_PREFIX, AGENT_STAGING
from hgxserve.base.runstate import per_run
from hgxserve.facts.runtime import HostPython
from hgxserve.operations.wheelhouse import push_wheelhouse
from hgxserve.runtime.agent_build import OWN_LOCK, python_problem, wheelhouse
from hgxserve.runtime.wheelhouse import LOCK_NAME, HostPlatform

AGENT_DIR = AGENT_PREFIX


def host_platform() -> HostPlatform:
    """The platform the host's python3 reports; DeployError naming it when the agent cannot run
    there (outside 3.10 to 3.13, or no python3)."""
    python = host.get_fact(HostPython)
    problem = python_problem(python.get("version"))
    if problem:
        raise DeployError(f"{host.name}: python3: {problem}")
    return HostPlatform(python["version"], python["machine"], python["glibc"])


@deploy("Install the hgxserve agent")
def agent(*, prefix: str = AGENT_DIR, python: str = "python3") -> None:
    """Install (or update) the hgxserve agent venv; nothing happens when it is current.

    + prefix: venv directory on the host
    + python: the host's python3 (3.10 to 3.13) the venv is created with; the wheels are
      built for the version, machine and glibc it reports
    """
    # site.py's stages each ask for the agent: handle each host once per run
    handled: set[str] = per_run(host.state, "agent-handled", set)
    if host.name in handled:
        return
    handled.add(host.name)
    tarball, key = wheelhouse(host_platform())
    marker = f"{prefix}/.agent-digest"
    q = shlex.quote
    installed = host.get_fact(Command, command=f"cat {q(marker)} 2>/dev/null || true")
    if (installed or "").strip() == key:
        host.noop(f"hgxserve agent {key} is already installed")
        return
    pushed = push_wheelhouse("agent", tarball, key, AGENT_STAGING)
    wheels, pip = q(pushed.path), q(prefix + "/bin/pip")
    install = (
        f"{pip} install -q --disable-pip-version-check --only-binary=:all: --no-index "
        f"--find-links {wheels} --require-hashes"
    )
    server.shell(
        name=f"Install the hgxserve agent {key} into {prefix}",
        commands=[
            pushed.unpack,
            # a venv whose interpreter went away (the host's Python was upgraded) is made anew
            f"{pip} --version >/dev/null 2>&1 || {q(python)} -m venv --clear {q(prefix)}",
            # every wheel of the wheelhouse, each by the sha256 the controller's lock names (a
            # dependency added since the installed agent is installed too), binary wheels only
            f"{install} -r {wheels}/{LOCK_NAME}",
            # hgxserve's own version stays 0.1.0 across sources: reinstalled, by its hash
            f"{install} --no-deps --force-reinstall -r {wheels}/{OWN_LOCK}",
            f"echo {q(key)} > {q(marker)}",
            pushed.cleanup,
        ],
    )
