"""pyinfra operation resizing the mounted /dev/shm live, for the host tuning role.

Example:
    from hgxserve.operations.tuning import shm_remounted
    shm_remounted(name="Resize /dev/shm", size_bytes=128 * 1024**3)
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import operation

from hgxserve.facts.host import ShmSize


def tmpfs_size_option(size_bytes: int) -> str:
    """tmpfs `size=` value with the largest exact binary suffix (tmpfs k/m/g are KiB/MiB/GiB).

    Example:
        >>> tmpfs_size_option(128 * 1024**3)
        '128g'
    """
    for suffix, factor in (("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if size_bytes % factor == 0:
            return f"{size_bytes // factor}{suffix}"
    return str(size_bytes)


@operation()
def shm_remounted(size_bytes: int):
    """Remount /dev/shm live with `size_bytes` when its mounted size differs.

    + size_bytes: wanted size of /dev/shm in bytes

    **Example:**

    .. code:: python

        shm_remounted(name="Resize /dev/shm", size_bytes=128 * 1024**3)
    """
    shm = host.get_fact(ShmSize)
    if shm["size_bytes"] == size_bytes:
        host.noop(f"/dev/shm is already {tmpfs_size_option(size_bytes)}")
        return
    yield f"mount -o remount,size={tmpfs_size_option(size_bytes)} /dev/shm"
