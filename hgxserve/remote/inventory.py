"""A pyinfra inventory read without pyinfra: its module-level lists of `(name, data)` become
groups, as pyinfra reads them, with `group_data/` beside it; each host keeps the data keys that say
how to reach it (`CONNECTION_KEYS`).

    inv = load_inventory("inventory/testhosts.py")
    hosts = inv.select(["hgx-a", "hgx-b"])
"""

from __future__ import annotations

import runpy
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONNECT_TIMEOUT_S = 5.0
# The pyinfra host data keys that say how to reach a host (all this module honours).
CONNECTION_KEYS = (
    "ssh_hostname",
    "ssh_port",
    "ssh_user",
    "ssh_password",
    "ssh_key",
    "ssh_key_password",
    "ssh_allow_agent",
    "ssh_look_for_keys",
    "ssh_forward_agent",
    "ssh_config_file",
    "ssh_known_hosts_file",
    "ssh_strict_host_key_checking",
    "ssh_paramiko_connect_kwargs",
    "ssh_connect_retries",
    "ssh_connect_retry_min_delay",
    "ssh_connect_retry_max_delay",
    "ssh_file_transfer_protocol",
)


class InventoryError(Exception):
    """The inventory cannot be read, or lacks a host the topology names."""


@dataclass
class InventoryHost:
    name: str
    data: dict[str, Any]
    groups: list[str] = field(default_factory=list)


@dataclass
class Inventory:
    path: str
    hosts: dict[str, InventoryHost]

    def select(self, names: Iterable[str]) -> list[InventoryHost]:
        """The named hosts, in order; InventoryError naming any the inventory lacks."""
        names = list(names)
        missing = [n for n in names if n not in self.hosts]
        if missing:
            raise InventoryError(
                f"{self.path}: no host(s) {', '.join(missing)} (the topology's host names must "
                f"be the inventory's; it has {', '.join(sorted(self.hosts)) or 'none'})"
            )
        return [self.hosts[n] for n in names]


def _is_group(name: str, value: Any) -> bool:
    if name.startswith("_"):
        return False
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value = value[0]
    return isinstance(value, list | tuple) and all(
        isinstance(item, str) or (isinstance(item, tuple) and len(item) == 2) for item in value
    )


def _group_data(directory: Path) -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = {}
    if not directory.is_dir():
        return data
    for path in sorted(directory.glob("*.py")):
        attrs = runpy.run_path(str(path))
        data[path.stem] = {
            k: v
            for k, v in attrs.items()
            if not k.startswith("_") and not callable(v) and type(v).__name__ != "module"
        }
    return data


def load_inventory(path: str) -> Inventory:
    """Read a pyinfra inventory file: groups of `name` or `(name, data)`, plus `group_data/`.

    Data precedence as pyinfra: the host's own data, then its groups' data, then `all`.
    """
    file = Path(path)
    if not file.is_file():
        raise InventoryError(f"{path}: no such inventory file")
    try:
        attrs = runpy.run_path(str(file))
    except SystemExit as exc:  # inventory/testhosts.py exits with a message when no hosts run
        raise InventoryError(f"{path}: {exc}") from None
    except Exception as exc:  # the inventory is the user's Python: say which file failed
        raise InventoryError(f"{path}: {type(exc).__name__}: {exc}") from None
    group_data = _group_data(file.parent / "group_data")
    hosts: dict[str, InventoryHost] = {}
    for group, value in attrs.items():
        if not _is_group(group, value):
            continue
        items, tuple_data = (value if isinstance(value, tuple) and len(value) == 2 and
                             isinstance(value[1], dict) else (value, {}))  # fmt: skip
        for item in items:
            name, data = (item, {}) if isinstance(item, str) else item
            host = hosts.setdefault(name, InventoryHost(name, {}))
            host.groups.append(group)
            host.data.update({**tuple_data, **group_data.get(group, {}), **dict(data)})
    if not hosts:
        raise InventoryError(f"{path}: defines no hosts")
    for host in hosts.values():
        host.data = {**group_data.get("all", {}), **host.data}
    return Inventory(str(file), hosts)
