"""pyinfra facts about the host around the GPUs: RDMA, peermem, /dev/shm, memlock, disk, OS,
CPUs and RAM.

Every command exits 0 when a tool or file is missing and reports that in its value.

Example:
    >>> host.get_fact(ShmSize)["size_bytes"]  # doctest: +SKIP
    137438953472
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Any

from hgxserve.base.paths import FIREWALL_FILE, FIREWALL_TABLE, NFT
from hgxserve.facts.common import Fact, NameList, keyed_values
from hgxserve.parsers.outputs import parse_ibv_devinfo, parse_os_release
from hgxserve.parsers.sections import split_sections

# /sys/class/infiniband/<dev>/ports/<n>/state reads e.g. "4: ACTIVE"; ibv_devinfo says
# PORT_ACTIVE. Facts use ibv_devinfo's words so topology checks have one vocabulary.
_SYSFS_STATE = {
    "DOWN": "PORT_DOWN",
    "INIT": "PORT_INIT",
    "ARMED": "PORT_ARMED",
    "ACTIVE": "PORT_ACTIVE",
    "ACTIVE_DEFER": "PORT_ACTIVE_DEFER",
}


class RdmaDevices(Fact):
    """RDMA devices with per-port state, rate and link layer (sysfs, then ibv_devinfo).

    sysfs is the kernel's own view and wins; `ibv_devinfo` adds firmware and board fields and
    is the only source on hosts without `/sys/class/infiniband`.

    Example:
        >>> host.get_fact(RdmaDevices)["devices"]["mlx5_0"]["ports"]["1"]["state"]  # doctest: +SKIP
        'PORT_ACTIVE'
    """

    empty = {"devices": {}, "ibv_devinfo": "absent"}

    def command(self) -> str:
        return (
            'for p in /sys/class/infiniband/*/ports/*; do [ -d "$p" ] || continue; '
            "d=${p#/sys/class/infiniband/}; d=${d%%/*}; n=${p##*/}; "
            'echo "sysfs $d $n $(cat "$p/state" 2>/dev/null)|$(cat "$p/rate" 2>/dev/null)|'
            '$(cat "$p/link_layer" 2>/dev/null)"; done; '
            "if command -v ibv_devinfo >/dev/null 2>&1; then "
            "echo '##ibv_devinfo'; ibv_devinfo 2>&1; echo \"##rc $?\"; "
            "else echo '##absent ibv_devinfo'; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        devices: dict[str, dict[str, Any]] = result["devices"]
        sysfs_lines = [line for line in output if line.startswith("sysfs ")]
        sections = split_sections([line for line in output if not line.startswith("sysfs ")])
        ibv = sections.get("ibv_devinfo")
        if ibv is not None:
            result["ibv_devinfo"] = "ok" if ibv["rc"] == 0 else "error"
            if ibv["rc"] == 0:
                for hca in parse_ibv_devinfo("\n".join(ibv["lines"])):
                    ports = {
                        str(port["port"]): {
                            "state": port.get("state"),
                            "rate_gbps": None,
                            "link_layer": port.get("link_layer"),
                        }
                        for port in hca.pop("ports")
                    }
                    devices[hca.pop("hca_id")] = {**hca, "ports": ports}
        for line in sysfs_lines:
            _, name, port, rest = line.split(" ", 3)
            state, rate, link_layer = (rest.split("|") + ["", "", ""])[:3]
            word = state.split(":", 1)[-1].strip()
            rate_match = re.match(r"\s*([\d.]+) Gb/sec", rate)
            entry = devices.setdefault(name, {"ports": {}})
            entry["ports"][port] = {
                "state": _SYSFS_STATE.get(word, word or None),
                "rate_gbps": float(rate_match.group(1)) if rate_match else None,
                "link_layer": link_layer.strip() or None,
            }
        return result


class PeermemLoaded(Fact):
    """Whether the `nvidia_peermem` module (GPUDirect RDMA) is loaded.

    Example:
        >>> host.get_fact(PeermemLoaded)  # doctest: +SKIP
        True
    """

    empty = False

    def command(self) -> str:
        return (
            "if grep -q '^nvidia_peermem ' /proc/modules 2>/dev/null "
            "|| [ -d /sys/module/nvidia_peermem ]; then echo loaded; else echo not-loaded; fi"
        )

    def process(self, output: list[str]) -> bool:
        return bool(output) and output[-1].strip() == "loaded"


class ShmSize(Fact):
    """Size, free space and filesystem type of /dev/shm, in bytes.

    Example:
        >>> host.get_fact(ShmSize)  # doctest: +SKIP
        {'fstype': 'tmpfs', 'size_bytes': 137438953472, 'avail_bytes': 137438953472}
    """

    empty = {"fstype": None, "size_bytes": None, "avail_bytes": None}

    def command(self) -> str:
        return (
            "if [ -d /dev/shm ]; then df -B1 --output=fstype,size,avail /dev/shm | tail -n 1; "
            "else echo absent; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        parts = output[-1].split() if output else []
        if len(parts) != 3 or not parts[1].isdigit():
            return self.default()
        return {"fstype": parts[0], "size_bytes": int(parts[1]), "avail_bytes": int(parts[2])}


class UnitMemlock(Fact):
    """The memlock limit a systemd service really gets, not what a login shell sees.

    `default` is systemd's DefaultLimitMEMLOCK (`infinity` or bytes); `unit` is `ulimit -l`
    inside a throwaway transient service (`unlimited` or KiB), which also covers drop-ins
    that `systemctl show` of the manager would not reveal until re-exec.

    Example:
        >>> host.get_fact(UnitMemlock)  # doctest: +SKIP
        {'default': 'infinity', 'unit': 'unlimited', 'infinity': True}
    """

    empty = {"default": None, "unit": None, "infinity": False}

    def command(self) -> str:
        return (
            "if command -v systemctl >/dev/null 2>&1; then "
            'echo "default $(systemctl show --property=DefaultLimitMEMLOCK --value 2>/dev/null)"; '
            "fi; "
            "if command -v systemd-run >/dev/null 2>&1; then "
            'echo "unit $(timeout 30 systemd-run --quiet --wait --pipe --collect '
            "sh -c 'ulimit -l' 2>/dev/null | tail -n 1)\"; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result = {**self.default(), **keyed_values(output, ("default", "unit"))}
        if result["unit"] is not None:
            result["infinity"] = result["unit"] == "unlimited"
        else:
            result["infinity"] = result["default"] == "infinity"
        return result


class HostResources(Fact):
    """The CPUs this host offers (`nproc`) and its RAM (/proc/meminfo MemTotal, in bytes).

    Example:
        >>> host.get_fact(HostResources)  # doctest: +SKIP
        {'cpus': 128, 'mem_total_bytes': 2163760152576}
    """

    empty = {"cpus": None, "mem_total_bytes": None}

    def command(self) -> str:
        return 'echo "nproc $(nproc 2>/dev/null)"; grep "^MemTotal:" /proc/meminfo; true'

    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        for line in output:
            words = line.split()
            if len(words) == 2 and words[0] == "nproc" and words[1].isdigit():
                result["cpus"] = int(words[1])
            elif len(words) >= 2 and words[0] == "MemTotal:" and words[1].isdigit():
                # /proc/meminfo says kB and means KiB
                result["mem_total_bytes"] = int(words[1]) * 1024
        return result


class DiskFree(Fact):
    """Free and total bytes of the filesystem that holds `path` (or would, once created).

    Also reports `present_bytes`, what is already stored under `path`, so a re-sync of a model
    that is mostly there does not need its full size free again.

    Example:
        >>> host.get_fact(DiskFree, path="/models/DeepSeek-V3.2")  # doctest: +SKIP
        {'path': '/models/DeepSeek-V3.2', 'mount': '/models', 'avail_bytes': ..., ...}
    """

    empty = {"mount": None, "avail_bytes": None, "size_bytes": None, "present_bytes": 0}

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return (
            f'p={quoted}; while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done; '
            'echo "df $(df -B1 --output=target,avail,size "$p" | tail -n 1)"; '
            f'if [ -e {quoted} ]; then echo "du $(du -sb {quoted} 2>/dev/null | cut -f1)"; fi'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        for line in output:
            key, _, value = line.partition(" ")
            parts = value.split()
            if key == "df" and len(parts) >= 3:
                result.update(mount=parts[0], avail_bytes=int(parts[1]), size_bytes=int(parts[2]))
            elif key == "du" and parts and parts[0].isdigit():
                result["present_bytes"] = int(parts[0])
        return result


class OsRelease(Fact):
    """/etc/os-release as a dict (`ID`, `VERSION_ID`, `VERSION_CODENAME`, ...).

    Example:
        >>> host.get_fact(OsRelease)["ID"]  # doctest: +SKIP
        'ubuntu'
    """

    empty = {}

    def command(self) -> str:
        return "cat /etc/os-release 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, str]:
        return parse_os_release("\n".join(output))


class HeldPackages(NameList):
    """Packages on hold in dpkg (`apt-mark showhold`).

    Example:
        >>> host.get_fact(HeldPackages)  # doctest: +SKIP
        ['nvidia-fabricmanager-570']
    """

    def requires_command(self) -> str:
        return "apt-mark"

    def command(self) -> str:
        return "apt-mark showhold"


class ControllerAddress(Fact):
    """The controller's address as this host sees it: the client address of the SSH connection
    the deploy runs over (`$SSH_CONNECTION`: client address, client port, server address, server
    port). The host firewall allows it on the engines' HTTP APIs (hgxserve.topology.firewall).
    None when the variable is unset (a local connector, or `sudo` that reset the environment)
    or not an IP address.

    Example:
        >>> host.get_fact(ControllerAddress)  # doctest: +SKIP
        '10.77.0.1'
    """

    empty = None

    def command(self) -> str:
        return 'printf "%s\\n" "${SSH_CONNECTION:-}"'

    def process(self, output: list[str]) -> str | None:
        words = " ".join(output).split()
        if not words:
            return None
        try:
            return str(ipaddress.ip_address(words[0].split("%", 1)[0]))
        except ValueError:
            return None


class HostFirewall(Fact):
    """Whether the host firewall the installed release carries is loaded: `loaded`, `missing`
    (the release file is installed but the table is gone: a `flush ruleset`, an nftables
    service restart) or `none` (no firewall file installed).

    Example:
        >>> host.get_fact(HostFirewall)  # doctest: +SKIP
        'loaded'
    """

    empty = "none"

    def command(self) -> str:
        return (
            f"if [ -f {shlex.quote(FIREWALL_FILE)} ]; then "
            f"if {shlex.quote(NFT)} list table {FIREWALL_TABLE} >/dev/null 2>&1; "
            "then echo loaded; else echo missing; fi; else echo none; fi"
        )

    def process(self, output: list[str]) -> str:
        word = " ".join(output).strip()
        return word if word in ("loaded", "missing") else "none"
