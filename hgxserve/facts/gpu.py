"""pyinfra facts about NVIDIA GPUs, NVSwitch, Fabric Manager and the loaded kernel module.

Every command exits 0 when a tool is missing and says so (`##absent nvidia-smi`), so a host
without a driver yet reports `status: absent` instead of failing the deploy.

Example:
    >>> from pyinfra import host
    >>> host.get_fact(GpuInventory)["count"]  # doctest: +SKIP
    8
"""

from __future__ import annotations

from typing import Any

from hgxserve.facts.common import Fact, keyed_values
from hgxserve.parsers.outputs import GPU_QUERY_FIELDS
from hgxserve.parsers.probes import (
    gpu_inventory_default,
    gpu_inventory_from_sections,
    upstream_version,
)
from hgxserve.parsers.sections import split_sections

QUERY_GPU = (
    "nvidia-smi --query-gpu=" + ",".join(GPU_QUERY_FIELDS) + " --format=csv,noheader,nounits"
)


def _run_section(name: str, command: str) -> str:
    return f"echo '##{name}'; {command} 2>&1; echo \"##rc $?\";"


class GpuInventory(Fact):
    """GPUs as nvidia-smi sees them: count, names, memory, UUIDs, driver, persistence, MIG.

    Uses `--query-gpu ... --format=csv,noheader,nounits`; if that query fails it falls back to
    the default table plus `nvidia-smi -L`. `status` is `ok`, `absent` (no nvidia-smi) or
    `error` (nvidia-smi ran and failed; `error` holds its output, e.g. "couldn't communicate
    with the NVIDIA driver").

    Example:
        >>> host.get_fact(GpuInventory)  # doctest: +SKIP
        {'status': 'ok', 'count': 8, 'driver_version': '570.158.01', 'gpus': [...]}
    """

    empty = gpu_inventory_default()

    def command(self) -> str:
        return (
            "if ! command -v nvidia-smi >/dev/null 2>&1; then echo '##absent nvidia-smi'; else "
            f"out=$({QUERY_GPU} 2>&1); rc=$?; "
            "echo '##query'; printf '%s\\n' \"$out\"; echo \"##rc $rc\"; "
            'if [ "$rc" -ne 0 ]; then '
            + _run_section("table", "nvidia-smi")
            + _run_section("list", "nvidia-smi -L")
            + " fi; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        return gpu_inventory_from_sections(split_sections(output))


class NvSwitchPresent(Fact):
    """Whether the host has NVSwitches (HGX 8-GPU boards), from the driver and from PCI.

    NVSwitches show in `/proc/driver/nvidia-nvswitch/devices/` once the driver is loaded and
    as NVIDIA PCI devices of class 0680 (bridge) before that.

    Example:
        >>> host.get_fact(NvSwitchPresent)  # doctest: +SKIP
        {'present': True, 'proc_devices': 4, 'pci_bridges': 4}
    """

    empty = {"present": False, "proc_devices": 0, "pci_bridges": None}

    def command(self) -> str:
        return (
            "n=0; for d in /proc/driver/nvidia-nvswitch/devices/*; do "
            '[ -e "$d" ] && n=$((n+1)); done; echo "proc $n"; '
            "if command -v lspci >/dev/null 2>&1; then "
            "echo \"pci $(lspci -n -d 10de: 2>/dev/null | grep -c ' 0680: ')\"; "
            "else echo 'pci absent'; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        for line in output:
            key, _, value = line.partition(" ")
            if key == "proc" and value.strip().isdigit():
                result["proc_devices"] = int(value)
            elif key == "pci" and value.strip().isdigit():
                result["pci_bridges"] = int(value)
        result["present"] = bool(result["proc_devices"] or result["pci_bridges"])
        return result


class FabricManagerState(Fact):
    """Fabric Manager package version(s), binary version and service state.

    The binary's own version is reported too: some distribution `nvidia-fabricmanager-<branch>`
    packages are empty transitional packages that pull in a newer branch, so the package
    version alone can lie.

    Example:
        >>> host.get_fact(FabricManagerState)  # doctest: +SKIP
        {'packages': {'nvidia-fabricmanager-570': '570.158.01-1'}, 'version': '570.158.01',
         'binary_version': '570.158.01', 'active': 'active', 'enabled': 'enabled'}
    """

    empty = {
        "packages": {},
        "version": None,
        "binary_version": None,
        "active": "unknown",
        "enabled": "unknown",
    }

    def requires_command(self) -> str:
        return "dpkg-query"

    def command(self) -> str:
        return (
            "dpkg-query -W -f='pkg ${Package} ${Version} ${db:Status-Abbrev}\\n' "
            "'nvidia-fabricmanager*' 2>/dev/null; "
            "if command -v nv-fabricmanager >/dev/null 2>&1; then "
            "echo \"binary $(nv-fabricmanager --version 2>&1 | tr '\\n' ' ')\"; fi; "
            'echo "active $(systemctl is-active nvidia-fabricmanager.service 2>/dev/null)"; '
            'echo "enabled $(systemctl is-enabled nvidia-fabricmanager.service 2>/dev/null)"'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        for line in output:
            key, _, rest = line.partition(" ")
            if key == "pkg":
                parts = rest.split()
                # Only installed (ii) or held-installed (hi) packages count.
                if (
                    len(parts) >= 3
                    and parts[2][1:2] == "i"
                    and not parts[0].startswith("nvidia-fabricmanager-dev")
                ):
                    result["packages"][parts[0]] = parts[1]
            elif key == "binary":
                result["binary_version"] = upstream_version(rest)
            elif key == "active":
                result["active"] = rest.strip() or "unknown"
            elif key == "enabled":
                result["enabled"] = rest.strip() or "not-found"
        versions = sorted(
            {v for v in map(upstream_version, result["packages"].values()) if v is not None}
        )
        result["version"] = result["binary_version"] or (versions[-1] if versions else None)
        return result


class NvidiaKernelModule(Fact):
    """The loaded `nvidia` module's version and the version installed for the running kernel.

    They differ after a driver upgrade until the host reboots (or the module is reloaded).

    Example:
        >>> host.get_fact(NvidiaKernelModule)  # doctest: +SKIP
        {'loaded': '550.90.12', 'installed': '570.158.01', 'reboot_required': True}
    """

    empty = {"loaded": None, "installed": None, "reboot_required": False}

    def command(self) -> str:
        return (
            'echo "loaded $(cat /sys/module/nvidia/version 2>/dev/null)"; '
            "if command -v modinfo >/dev/null 2>&1; then "
            'echo "installed $(modinfo -F version nvidia 2>/dev/null)"; fi'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result = {**self.default(), **keyed_values(output, ("loaded", "installed"))}
        result["reboot_required"] = bool(
            result["loaded"] and result["installed"] and result["loaded"] != result["installed"]
        )
        return result
