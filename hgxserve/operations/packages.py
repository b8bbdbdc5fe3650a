"""pyinfra operation installing apt packages at an upstream version, and holding them.

Example:
    from hgxserve.operations.packages import pinned_packages
    pinned_packages(name="Install RDMA packages", packages=["rdma-core"])
"""

from __future__ import annotations

import shlex
from datetime import datetime, timezone

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File
from pyinfra.facts.server import Date

from hgxserve.facts.host import HeldPackages
from hgxserve.parsers.probes import upstream_version

APT_CACHE_SECONDS = 86400
APT_UPDATE_STAMP = "/var/lib/apt/periodic/update-success-stamp"
APT_ENV = "DEBIAN_FRONTEND=noninteractive"
APT_INSTALL = (
    "apt-get -y -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "
    "install --no-install-recommends --allow-downgrades --allow-change-held-packages"
)


@operation()
def pinned_packages(
    packages: list[str],
    version: str | None = None,
    hold: bool = False,
    cache_time: int = APT_CACHE_SECONDS,
):
    """Install apt packages (at an upstream version, if given) and optionally hold them.

    Refreshes the apt lists only when something must be installed and the lists are older
    than `cache_time`, so a converged host runs no `apt-get update`.

    + packages: package names
    + version: upstream version every package must have (`570.158.01`), None for any
    + hold: `apt-mark hold` the packages so `apt upgrade` leaves them alone
    + cache_time: seconds the apt lists count as fresh

    **Example:**

    .. code:: python

        pinned_packages(
            name="Install Fabric Manager 570.158.01",
            packages=["nvidia-fabricmanager-570"],
            version="570.158.01",
            hold=True,
        )
    """
    installed = host.get_fact(DebPackages)
    missing = [
        name
        for name in packages
        if not any(
            version is None or upstream_version(have) == version for have in installed.get(name, [])
        )
    ]
    held = set(host.get_fact(HeldPackages)) if hold else set()
    unheld = [name for name in packages if name not in held] if hold else []
    if missing:
        stamp = host.get_fact(File, path=APT_UPDATE_STAMP)
        fresh = False
        mtime = stamp.get("mtime") if stamp else None
        if mtime is not None:
            # File mtimes are naive UTC; read the host clock the same way (as apt.update does).
            now = datetime.fromtimestamp(host.get_fact(Date).timestamp(), timezone.utc)
            age = now.replace(tzinfo=None) - mtime
            fresh = age.total_seconds() < cache_time
        if not fresh:
            yield f"{APT_ENV} apt-get update"
            yield f"touch {APT_UPDATE_STAMP}"
        yield f"{APT_ENV} {APT_INSTALL} {shlex.join(missing)}"
    if unheld:
        yield f"apt-mark hold {shlex.join(unheld)}"
    if not missing and not unheld:
        at = f" at {version}" if version else ""
        host.noop(f"{', '.join(packages)} already installed{at}{' and held' if hold else ''}")
