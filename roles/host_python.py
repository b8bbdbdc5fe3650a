"""Make the host's python3 able to create venvs: the agent (/opt/hgxserve) and the engine
runtimes are venvs of the host's own interpreter, and Debian and Ubuntu ship `venv`'s ensurepip
in a package of their own (`python3.10-venv` on Ubuntu 22.04, `python3.12-venv` on 24.04,
`python3.11-venv` on Debian 12, `python3.13-venv` on Debian 13).

The package comes from the host's configured apt sources (HGX hosts are offline: a lab mirror);
a host that has it changes nothing and runs no `apt-get update`. Other distributions are left
alone (their python3 carries venv).

Example:
    from roles.host_python import host_python
    host_python()
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import DeployError, deploy

from hgxserve.facts.host import OsRelease
from hgxserve.facts.runtime import HostPython
from hgxserve.operations.packages import APT_CACHE_SECONDS, pinned_packages
from hgxserve.runtime.agent_build import python_problem


def venv_package(os_release: dict[str, str], version: str) -> str | None:
    """The package that gives `python<version>` its venv on this distribution (None: not apt).

    >>> venv_package({"ID": "ubuntu", "ID_LIKE": "debian"}, "3.10")
    'python3.10-venv'
    >>> venv_package({"ID": "rhel"}, "3.12") is None
    True
    """
    family = {os_release.get("ID", ""), *os_release.get("ID_LIKE", "").split()}
    return f"python{version}-venv" if family & {"debian", "ubuntu"} else None


@deploy("Prepare the host's Python for venvs")
def host_python(cache_time: int = APT_CACHE_SECONDS) -> None:
    """Install `python3.X-venv` for the host's python3 (X from the host's facts).

    + cache_time: seconds the apt lists count as fresh
    """
    python = host.get_fact(HostPython)
    version = python.get("version")
    problem = python_problem(version)
    if problem:
        raise DeployError(f"{host.name}: python3: {problem}")
    package = venv_package(host.get_fact(OsRelease), version)
    if package is None:
        host.noop("python3 venv: not a Debian/Ubuntu host, nothing to install")
        return
    pinned_packages(
        name=f"Install {package} (venvs of the host's Python {version})",
        packages=[package],
        cache_time=cache_time,
    )
