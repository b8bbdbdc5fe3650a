"""pyinfra facts about NVIDIA GPUs, NVSwitch, Fabric Manager and the loaded kernel module.

Every command exits 0 when a tool is missing and says so (`##absent nvidia-smi`), so a host
without a driver yet reports `status: absent` instead of failing the deploy.

Example:
    >>> from pyinfra import host
    >>> host.get_fact(GpuInventory)["count"]  # doctest: +SKIP
    8
"""

from __future__ import annotations

import re
from typing import Any

from pyinfra.api import FactBase

from hgxserve.facts import parsers

QUERY_GPU = (
    "nvidia-smi --query-gpu="
    + ",".join(parsers.GPU_QUERY_FIELDS)
    + " --format=csv,noheader,nounits"
)


def split_sections(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Split `##name` ... `##rc N` marked output into {name: {"lines": [...], "rc": N}}.

    `##absent TOOL` lines become {"absent TOOL": {"lines": [], "rc": None}}.

    Example:
        >>> split_sections(["##query", "a", "##rc 0"])
        {'query': {'lines': ['a'], 'rc': 0}}
    """
    sections: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in lines:
        if line.startswith("##rc ") and current is not None:
            current["rc"] = int(line[5:].strip() or 0)
            current = None
        elif line.startswith("##"):
            current = {"lines": [], "rc": None}
            sections[line[2:].strip()] = current
        elif current is not None:
            current["lines"].append(line)
    return sections


def _run_section(name: str, command: str) -> str:
    return f"echo '##{name}'; {command} 2>&1; echo \"##rc $?\";"


class GpuInventory(FactBase):
    """GPUs as nvidia-smi sees them: count, names, memory, UUIDs, driver, persistence, MIG.

    Uses `--query-gpu ... --format=csv,noheader,nounits`; if that query fails it falls back to
    the default table plus `nvidia-smi -L`. `status` is `ok`, `absent` (no nvidia-smi) or
    `error` (nvidia-smi ran and failed; `error` holds its output, e.g. "couldn't communicate
    with the NVIDIA driver").

    Example:
        >>> host.get_fact(GpuInventory)  # doctest: +SKIP
        {'status': 'ok', 'count': 8, 'driver_version': '570.158.01', 'gpus': [...]}
    """

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

    @staticmethod
    def default() -> dict[str, Any]:
        return {"status": "absent", "count": 0, "driver_version": None, "gpus": [], "error": None}

    def process(self, output: list[str]) -> dict[str, Any]:
        return gpu_inventory_from_sections(split_sections(output))


def gpu_inventory_from_sections(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Build the GpuInventory value from split command output (see GpuInventory).

    Example:
        >>> gpu_inventory_from_sections({"absent nvidia-smi": {"lines": [], "rc": None}})["status"]
        'absent'
    """
    result = GpuInventory.default()
    if "absent nvidia-smi" in sections:
        return result
    query = sections.get("query")
    if query and query["rc"] == 0:
        try:
            gpus = parsers.gpus_from_query("\n".join(query["lines"]))
        except ValueError:
            gpus = None
        if gpus is not None:
            drivers = {gpu.pop("driver_version") for gpu in gpus}
            result.update(
                status="ok",
                gpus=gpus,
                count=len(gpus),
                driver_version=sorted(d for d in drivers if d)[0] if any(drivers) else None,
            )
            return result
    table = sections.get("table")
    if table is None and query and any("NVIDIA-SMI" in line for line in query["lines"]):
        # An nvidia-smi that ignores --query-gpu and prints its table anyway.
        table = query
    if table and table["rc"] == 0:
        parsed = parsers.parse_smi_table("\n".join(table["lines"]))
        listed = sections.get("list") or {"lines": [], "rc": 1}
        uuids = {gpu["index"]: gpu for gpu in parsers.parse_smi_list("\n".join(listed["lines"]))}
        gpus = [
            {
                "index": gpu["index"],
                "name": uuids.get(gpu["index"], {}).get("name", gpu["name"]),
                "uuid": uuids.get(gpu["index"], {}).get("uuid"),
                "memory_total_mib": gpu["memory_total_mib"],
                "memory_used_mib": gpu["memory_used_mib"],
                "persistence_mode": gpu["persistence_mode"],
                "mig_mode": gpu["mig_mode"],
            }
            for gpu in parsed["gpus"]
        ]
        result.update(
            status="ok", gpus=gpus, count=len(gpus), driver_version=parsed["driver_version"]
        )
        return result
    failed = table or query or {"lines": []}
    result.update(status="error", error="\n".join(failed["lines"]).strip() or "no output")
    return result


class NvSwitchPresent(FactBase):
    """Whether the host has NVSwitches (HGX 8-GPU boards), from the driver and from PCI.

    NVSwitches show in `/proc/driver/nvidia-nvswitch/devices/` once the driver is loaded and
    as NVIDIA PCI devices of class 0680 (bridge) before that.

    Example:
        >>> host.get_fact(NvSwitchPresent)  # doctest: +SKIP
        {'present': True, 'proc_devices': 4, 'pci_bridges': 4}
    """

    def command(self) -> str:
        return (
            "n=0; for d in /proc/driver/nvidia-nvswitch/devices/*; do "
            '[ -e "$d" ] && n=$((n+1)); done; echo "proc $n"; '
            "if command -v lspci >/dev/null 2>&1; then "
            "echo \"pci $(lspci -n -d 10de: 2>/dev/null | grep -c ' 0680: ')\"; "
            "else echo 'pci absent'; fi"
        )

    @staticmethod
    def default() -> dict[str, Any]:
        return {"present": False, "proc_devices": 0, "pci_bridges": None}

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


def upstream_version(version: str | None) -> str | None:
    """The driver version inside a Debian package version (`570.158.01-0ubuntu1` -> `570.158.01`).

    Example:
        >>> upstream_version("1:570.158.01-1")
        '570.158.01'
    """
    if not version:
        return None
    match = re.search(r"(?:\d+:)?(\d+\.\d+(?:\.\d+)?)", version)
    return match.group(1) if match else None


class FabricManagerState(FactBase):
    """Fabric Manager package version(s), binary version and service state.

    The binary's own version is reported too: some distribution `nvidia-fabricmanager-<branch>`
    packages are empty transitional packages that pull in a newer branch, so the package
    version alone can lie.

    Example:
        >>> host.get_fact(FabricManagerState)  # doctest: +SKIP
        {'packages': {'nvidia-fabricmanager-570': '570.158.01-1'}, 'version': '570.158.01',
         'binary_version': '570.158.01', 'active': 'active', 'enabled': 'enabled'}
    """

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

    @staticmethod
    def default() -> dict[str, Any]:
        return {
            "packages": {},
            "version": None,
            "binary_version": None,
            "active": "unknown",
            "enabled": "unknown",
        }

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


class NvidiaKernelModule(FactBase):
    """The loaded `nvidia` module's version and the version installed for the running kernel.

    They differ after a driver upgrade until the host reboots (or the module is reloaded).

    Example:
        >>> host.get_fact(NvidiaKernelModule)  # doctest: +SKIP
        {'loaded': '550.90.12', 'installed': '570.158.01', 'reboot_required': True}
    """

    def command(self) -> str:
        return (
            'echo "loaded $(cat /sys/module/nvidia/version 2>/dev/null)"; '
            "if command -v modinfo >/dev/null 2>&1; then "
            'echo "installed $(modinfo -F version nvidia 2>/dev/null)"; fi'
        )

    @staticmethod
    def default() -> dict[str, Any]:
        return {"loaded": None, "installed": None, "reboot_required": False}

    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        for line in output:
            key, _, value = line.partition(" ")
            if key in ("loaded", "installed"):
                result[key] = value.strip() or None
        result["reboot_required"] = bool(
            result["loaded"] and result["installed"] and result["loaded"] != result["installed"]
        )
        return result
