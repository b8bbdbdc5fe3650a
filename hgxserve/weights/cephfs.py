"""The read-only CephFS mount of a model store: a systemd .mount unit for the kernel client.

unit_name("/mnt/hgxserve-models")  # "mnt-hgxserve\\x2dmodels.mount"
text = mount_unit(["10.0.0.1:6789"], "/models", "models-ro", "/etc/ceph/models.secret",
                  "/mnt/hgxserve-models")
"""

from __future__ import annotations

from hgxserve.base.units import mount_unit_name as unit_name
from hgxserve.base.units import unit_value

__all__ = ["mount_unit", "unit_name"]


def mount_unit(
    monitors: list[str] | tuple[str, ...], path: str, user: str, secret_file: str, where: str
) -> str:
    """The .mount unit text: kernel client, `ro` in the options, the key only by file reference.

    mount_unit(["10.0.0.1:6789"], "/models", "models-ro", "/etc/ceph/s", "/mnt/m")
    """
    for value in (user, secret_file, *monitors):
        # a comma would add a mount option of its own (`x,rw` would drop `ro`)
        if "," in value or "=" in value or not value.strip():
            raise ValueError(f"CephFS mount value {value!r} may not hold ',' or '='")
    what = unit_value(",".join(monitors) + ":" + path)
    where = unit_value(where)
    options = unit_value(f"name={user},secretfile={secret_file},ro,noatime,_netdev")
    return (
        "# Managed by hgxserve: read-only CephFS model store (kernel client).\n"
        "[Unit]\n"
        "Description=hgxserve model store (CephFS, read-only)\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Mount]\n"
        f"What={what}\n"
        f"Where={where}\n"
        "Type=ceph\n"
        f"Options={options}\n"
        "TimeoutSec=60\n"
        "\n"
        "[Install]\n"
        "WantedBy=remote-fs.target\n"
    )
