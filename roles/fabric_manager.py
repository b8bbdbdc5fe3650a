"""Install NVIDIA Fabric Manager at exactly the driver's version, only on NVSwitch hosts.

On HGX 8-GPU boards (H20, H200, H100) the GPUs talk through NVSwitches that Fabric Manager
configures; without it, or with a version other than the driver's, CUDA fails with error 802
("system not yet initialized") while `nvidia-smi` looks healthy. The package
`nvidia-fabricmanager-<branch>` comes from NVIDIA's CUDA repository (the `-1` builds; Ubuntu's
own multiverse `nvidia-fabricmanager-570` can be a transitional package that pulls in another
branch), pinned by the driver role's apt preferences and held here.

Example:
    from roles.fabric_manager import fabric_manager
    fabric_manager(version="570.158.01")
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import DeployError, deploy
from pyinfra.operations import systemd

from hgxserve.facts.gpu import NvSwitchPresent
from hgxserve.operations.packages import APT_CACHE_SECONDS, pinned_packages
from roles.nvidia_driver import DRIVER_BRANCH, DRIVER_VERSION

FABRIC_MANAGER_SERVICE = "nvidia-fabricmanager.service"


def fabric_manager_packages(branch: str = DRIVER_BRANCH) -> list[str]:
    """Fabric Manager package names for a driver branch (same on Ubuntu and Debian).

    Example:
        >>> fabric_manager_packages("570")
        ['nvidia-fabricmanager-570']
    """
    return [f"nvidia-fabricmanager-{branch}"]


@deploy("Install Fabric Manager")
def fabric_manager(
    version: str = DRIVER_VERSION,
    branch: str | None = None,
    require_nvswitch: bool = True,
    cache_time: int = APT_CACHE_SECONDS,
) -> None:
    """Install Fabric Manager at `version`, hold it, and keep its service enabled and running.

    + version: the driver's exact upstream version (`570.158.01`)
    + branch: driver branch, default the first part of `version`
    + require_nvswitch: skip hosts without NVSwitches (set False to install anyway)
    + cache_time: seconds the apt lists count as fresh

    Example:
        fabric_manager(version="570.158.01")
    """
    branch = branch or version.split(".")[0]
    if version.split(".")[0] != branch:
        raise DeployError(f"{host.name}: fabric manager {version} is not on branch {branch}")
    if require_nvswitch and not host.get_fact(NvSwitchPresent)["present"]:
        logger.info(f"{host.print_prefix}no NVSwitch: Fabric Manager not needed")
        return
    install = pinned_packages(
        name=f"Install Fabric Manager {version} (same version as the driver)",
        packages=fabric_manager_packages(branch),
        version=version,
        hold=True,
        cache_time=cache_time,
    )
    service = systemd.service(
        name="Enable and start Fabric Manager",
        service=FABRIC_MANAGER_SERVICE,
        running=True,
        enabled=True,
    )
    # A running Fabric Manager keeps the old binary until restarted; start above covers the
    # first install, so restart only an already-running service after a package change.
    systemd.service(
        name="Restart Fabric Manager after its package changed",
        service=FABRIC_MANAGER_SERVICE,
        restarted=True,
        _if=[install.did_change, service.did_not_change],
    )
