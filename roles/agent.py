"""Agent role: install hgxserve into /opt/hgxserve on a host with no internet access, from a
wheelhouse built on the controller (the host-side commands units and deploys call)."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command
from pyinfra.operations import server

from hgxserve.base.paths import AGENT_PREFIX, AGENT_STAGING
from hgxserve.base.runstate import per_run
from hgxserve.operations.wheelhouse import push_wheelhouse
from hgxserve.runtime.agent_build import wheelhouse

AGENT_DIR = AGENT_PREFIX


@deploy("Install the hgxserve agent")
def agent(*, prefix: str = AGENT_DIR, python: str = "python3") -> None:
    """Install (or update) the hgxserve agent venv; nothing happens when it is current.

    + prefix: venv directory on the host
    + python: the host's Python 3.11 used to create the venv
    """
    # site.py's stages each ask for the agent: handle each host once per run
    handled: set[str] = per_run(host.state, "agent-handled", set)
    if host.name in handled:
        return
    handled.add(host.name)
    tarball, digest = wheelhouse()
    marker = f"{prefix}/.agent-digest"
    q = shlex.quote
    installed = host.get_fact(Command, command=f"cat {q(marker)} 2>/dev/null || true")
    if (installed or "").strip() == digest:
        host.noop(f"hgxserve agent {digest} is already installed")
        return
    pushed = push_wheelhouse("agent", tarball, digest, AGENT_STAGING)
    wheels, pip = q(pushed.path), q(prefix + "/bin/pip")
    server.shell(
        name=f"Install the hgxserve agent {digest} into {prefix}",
        commands=[
            pushed.unpack,
            f"test -x {pip} || {q(python)} -m venv {q(prefix)}",
            # every wheel of the wheelhouse: a dependency added since the installed agent is
            # installed too (asking for `hgxserve` alone would be satisfied by the old one)
            f"{pip} install -q --no-index --find-links {wheels} {wheels}/*.whl",
            f"{pip} install -q --no-index --find-links {wheels} --no-deps --force-reinstall "
            "hgxserve",
            f"echo {q(digest)} > {q(marker)}",
            pushed.cleanup,
        ],
    )
