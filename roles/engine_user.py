"""Engine user role: the unprivileged system user every venv engine unit runs as (User=), and
its home, converged: a second run changes nothing.

A system user and group of one name (hgxserve.base.defaults.ENGINE_USER), no login shell, its
home the state directory hgxserve.base.paths.ENGINE_HOME (made here, 0750, not from a skeleton),
and the supplementary groups of ENGINE_GROUPS that exist on the host (`video` where the NVIDIA
driver's NVreg_DeviceFileGID gives /dev/nvidia* to it, `rdma` where a site restricts
/dev/infiniband/*); groups the host lacks are left out, not created.

Example:
    from roles.engine_user import engine_user
    engine_user()
"""

from __future__ import annotations

from collections.abc import Sequence

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Groups
from pyinfra.operations import files, server

from hgxserve.base.defaults import ENGINE_GROUPS, ENGINE_SHELL, ENGINE_USER
from hgxserve.base.paths import ENGINE_HOME


@deploy("Engine user")
def engine_user(
    *, user: str = ENGINE_USER, home: str = ENGINE_HOME, groups: Sequence[str] = ENGINE_GROUPS
) -> None:
    """Create (or bring back in line) the engine user, its group and home.

    + user: the user's name, also its primary group's
    + home: its home directory (a state directory; owned by it, 0750)
    + groups: supplementary groups it joins where the host has them
    """
    present: list[str] = host.get_fact(Groups)
    joins = [g for g in groups if g in present]
    server.group(name=f"Engine group {user}", group=user, system=True)
    server.user(
        name=f"Engine user {user} (system, no login, groups: {', '.join(joins) or 'none'})",
        user=user,
        group=user,
        groups=joins,
        system=True,
        home=home,
        shell=ENGINE_SHELL,
        ensure_home=False,
        create_home=False,
    )
    files.directory(
        name=f"Home of {user}: {home}",
        path=home,
        user=user,
        group=user,
        mode="750",
    )
