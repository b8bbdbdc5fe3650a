"""Install the RDMA userspace (rdma-core, verbs tools, perftest, UCX) and load nvidia-peermem.

`nvidia-peermem` lets the NIC access GPU memory directly (GPUDirect RDMA), which NIXL/UCX KV
transfer between prefill and decode uses across hosts; it is loaded at every boot through
modules-load.d.

Example:
    from roles.rdma import rdma
    rdma(load_now=True)
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import files, server

from hgxserve.operations.packages import APT_CACHE_SECONDS, pinned_packages
from roles.nvidia_driver import TEMPLATES

RDMA_PACKAGES = (
    "rdma-core",
    "ibverbs-utils",  # ibv_devinfo, ibv_devices
    "infiniband-diags",  # ibstat
    "perftest",  # ib_write_bw / ib_read_bw link checks
    "libucx0",
    "ucx-utils",  # ucx_info: which transports UCX sees
)
PEERMEM_CONF = "/etc/modules-load.d/nvidia-peermem.conf"


@deploy("Install RDMA and UCX")
def rdma(
    packages: tuple[str, ...] | list[str] = RDMA_PACKAGES,
    peermem: bool = True,
    load_now: bool = True,
    cache_time: int = APT_CACHE_SECONDS,
) -> None:
    """Install RDMA/UCX packages and load nvidia-peermem now and at boot.

    + packages: apt packages to install
    + peermem: configure nvidia-peermem (GPUDirect RDMA)
    + load_now: also modprobe nvidia-peermem now (needs the NVIDIA driver loaded)
    + cache_time: seconds the apt lists count as fresh

    Example:
        rdma(load_now=False)
    """
    pinned_packages(
        name="Install RDMA and UCX packages",
        packages=list(packages),
        cache_time=cache_time,
    )
    if not peermem:
        return
    files.put(
        name="Load nvidia-peermem at boot",
        src=str(TEMPLATES / "modules-load-peermem.conf"),
        dest=PEERMEM_CONF,
        mode="644",
    )
    if load_now:
        server.modprobe(name="Load nvidia-peermem now", module="nvidia_peermem")
