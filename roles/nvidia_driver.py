"""Install the NVIDIA datacenter driver (open kernel modules) at one pinned version.

The pinned `DRIVER_BRANCH` and `DRIVER_VERSION` live once in hgxserve.topology.cuda (next to
the CUDA <-> driver table that topology validation checks runtimes against); the fabric manager
role imports them from here so the two can never drift apart. Packages come from NVIDIA's CUDA
repository for the host's distribution:

| distribution | packages (open kernel modules, no X) |
|---|---|
| Ubuntu 22.04 / 24.04 | `nvidia-headless-<branch>-open`, `nvidia-utils-<branch>` |
| Debian 12 | `nvidia-driver-cuda`, `nvidia-kernel-open-dkms`, `nvidia-persistenced` |

An apt preferences file pins every NVIDIA package to `<version>-*` (Debian's names carry no
branch, and `cuda-drivers-<branch>` depends on `>=` versions), and the packages are held.
The role never reboots: when the loaded module differs from the installed one it says
"reboot required".

With `ibgda=True` (a host whose engine runs DeepEP across hosts) it writes the nvidia module
options IBGDA needs to /etc/modprobe.d/hgxserve-nvidia-ibgda.conf (and removes them when not
asked for); a change rebuilds the initramfs and says "reboot required", since the
options are read when the module loads.

Example:
    from roles.nvidia_driver import nvidia_driver
    nvidia_driver(branch="570", version="570.158.01")
"""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import DeployError, deploy
from pyinfra.operations import apt, files, python, server, systemd

import hgxserve
from hgxserve.facts.gpu import NvidiaKernelModule
from hgxserve.facts.host import OsRelease
from hgxserve.operations.packages import APT_CACHE_SECONDS, pinned_packages
from hgxserve.topology.cuda import DRIVER_BRANCH, DRIVER_VERSION

NVIDIA_SOURCE_FILE = "/etc/apt/sources.list.d/hgxserve-nvidia.list"
NVIDIA_PIN_FILE = "/etc/apt/preferences.d/hgxserve-nvidia"
NVIDIA_KEYRING = "/etc/apt/keyrings/nvidia-cuda.asc"
IBGDA_CONF = "/etc/modprobe.d/hgxserve-nvidia-ibgda.conf"
CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64/"
# NVIDIA's CUDA repository signing key since the 2022 rotation.
CUDA_REPO_KEY = CUDA_REPO + "3bf863cc.pub"
# Package name patterns the pin covers; packages of other versions (container toolkit) simply
# find no matching version and keep their normal priority.
PIN_PATTERNS = ("*nvidia*", "libcuda*", "cuda-drivers*", "libxnvctrl*")
TEMPLATES = Path(hgxserve.__file__).parent / "files" / "provision"


def cuda_distro(os_release: dict[str, str]) -> str:
    """NVIDIA's repository name for this OS (`ubuntu2404`, `debian12`); DeployError if unsupported.

    Example:
        >>> cuda_distro({"ID": "ubuntu", "VERSION_ID": "22.04"})
        'ubuntu2204'
    """
    os_id, version = os_release.get("ID", ""), os_release.get("VERSION_ID", "")
    supported = {("ubuntu", "22.04"), ("ubuntu", "24.04"), ("debian", "12")}
    if (os_id, version) not in supported:
        raise DeployError(
            f"{host.name}: os: expected Ubuntu 22.04/24.04 or Debian 12, found "
            f"{os_release.get('PRETTY_NAME') or (os_id + ' ' + version).strip() or 'unknown'}"
        )
    return f"{os_id}{version.replace('.', '')}"


def driver_packages(os_release: dict[str, str], branch: str = DRIVER_BRANCH) -> list[str]:
    """Compute-only driver packages with open kernel modules for this OS and branch.

    Example:
        >>> driver_packages({"ID": "debian", "VERSION_ID": "12"})
        ['nvidia-driver-cuda', 'nvidia-kernel-open-dkms', 'nvidia-persistenced']
    """
    if cuda_distro(os_release).startswith("ubuntu"):
        return [f"nvidia-headless-{branch}-open", f"nvidia-utils-{branch}"]
    return ["nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-persistenced"]


def _warn_reboot(message: str) -> None:
    logger.warning(f"{host.print_prefix}{message}")


def apt_source(source_line: str, path: str, keyring_url: str | None = None):
    """Write one apt source file (and its signing key); return the ops that can change lists.

    Example:
        ops = apt_source("deb [trusted=yes] file:/srv/repo ./", "/etc/apt/sources.list.d/r.list")
    """
    ops = []
    if keyring_url:
        ops.append(
            files.download(
                name="Fetch the NVIDIA CUDA repository signing key",
                src=keyring_url,
                dest=NVIDIA_KEYRING,
                mode="644",
            )
        )
    ops.append(
        files.put(
            name=f"Add apt source {path}",
            src=StringIO(source_line.rstrip("\n") + "\n"),
            dest=path,
            mode="644",
        )
    )
    return ops


@deploy("Install the NVIDIA driver")
def nvidia_driver(  # noqa: PLR0913 - a deploy: one keyword per option of the provision plan
    branch: str | None = None,
    version: str = DRIVER_VERSION,
    source: str | None = None,
    persistence: bool = True,
    cache_time: int = APT_CACHE_SECONDS,
    ibgda: bool = False,
) -> None:
    """Install the driver at `version` from NVIDIA's CUDA repository and enable persistence.

    + branch: driver branch (`570`); must be the first part of `version` (default: that part)
    + version: exact upstream driver version (`570.158.01`)
    + source: apt source line to use instead of NVIDIA's repository (a local mirror)
    + persistence: enable and start nvidia-persistenced
    + cache_time: seconds the apt lists count as fresh
    + ibgda: set the nvidia module options IBGDA needs (DeepEP across hosts); remove them if not

    Example:
        nvidia_driver(version="570.158.01", source="deb [trusted=yes] file:/srv/repo ./")
    """
    branch = branch or version.split(".")[0]
    if version.split(".")[0] != branch:
        raise DeployError(f"{host.name}: driver version {version} is not on branch {branch}")
    os_release = host.get_fact(OsRelease)
    distro = cuda_distro(os_release)
    if source is None:
        source = f"deb [signed-by={NVIDIA_KEYRING}] {CUDA_REPO.format(distro=distro)} /"
        keyring_url: str | None = CUDA_REPO_KEY.format(distro=distro)
    else:
        keyring_url = None
    list_ops = apt_source(source, NVIDIA_SOURCE_FILE, keyring_url)
    pin = files.template(
        name=f"Pin NVIDIA driver packages to {version}",
        src=str(TEMPLATES / "apt-preferences-nvidia.j2"),
        dest=NVIDIA_PIN_FILE,
        mode="644",
        version=version,
        patterns=PIN_PATTERNS,
    )
    list_ops.append(pin)
    apt.update(
        name="Refresh apt lists after the NVIDIA source changed",
        _if=lambda: any(op.did_change() for op in list_ops),
    )
    module = host.get_fact(NvidiaKernelModule)
    install = pinned_packages(
        name=f"Install NVIDIA driver {version} (open kernel modules)",
        packages=driver_packages(os_release, branch),
        version=version,
        hold=True,
        cache_time=cache_time,
    )
    if module["reboot_required"]:
        _warn_reboot(
            f"reboot required: nvidia module {module['loaded']} is loaded, "
            f"{module['installed']} is installed"
        )
    elif module["loaded"] != version:
        python.call(
            name="Report that the new driver needs a reboot",
            function=_warn_reboot,
            message=(
                f"reboot required: driver {version} installed, "
                f"{'nvidia module ' + module['loaded'] if module['loaded'] else 'no nvidia module'}"
                " loaded"
            ),
            _if=install.did_change,
        )
    _ibgda_options(ibgda)
    if persistence:
        systemd.service(
            name="Enable the NVIDIA persistence daemon",
            service="nvidia-persistenced.service",
            running=True,
            enabled=True,
        )


def _ibgda_options(enabled: bool) -> None:
    """Write (or remove) the nvidia module options IBGDA needs; a change rebuilds the initramfs
    and says "reboot required" (the module reads them when it loads)."""
    if enabled:
        conf = files.put(
            name="Set the nvidia module options for IBGDA (DeepEP across hosts)",
            src=str(TEMPLATES / "modprobe-nvidia-ibgda.conf"),
            dest=IBGDA_CONF,
            mode="644",
        )
    else:
        conf = files.file(
            name="No IBGDA module options (no DeepEP across hosts)",
            path=IBGDA_CONF,
            present=False,
        )
    server.shell(
        name="Rebuild the initramfs with the nvidia module options",
        commands=["update-initramfs -u"],
        _if=conf.did_change,
    )
    python.call(
        name="Report that the nvidia module options need a reboot",
        function=_warn_reboot,
        message=f"reboot required: the nvidia module options in {IBGDA_CONF} changed "
        "(IBGDA for DeepEP); they apply when the module loads",
        _if=conf.did_change,
    )
