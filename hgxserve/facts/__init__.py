"""Host facts for preflight and provisioning: pyinfra facts plus pure parsers of real outputs.

`HOST_FACTS` maps the short names used in `hgxserve facts` JSON and in preflight checks to the
pyinfra fact classes, so the controller and the host read the same commands the same way.

Example:
    >>> from hgxserve.facts import HOST_FACTS
    >>> sorted(HOST_FACTS)[:3]
    ['disk', 'fabric_manager', 'gpu']
"""

from __future__ import annotations

from hgxserve.facts.gpu import FabricManagerState, GpuInventory, NvidiaKernelModule, NvSwitchPresent
from hgxserve.facts.host import (
    DiskFree,
    HeldPackages,
    OsRelease,
    PeermemLoaded,
    RdmaDevices,
    ShmSize,
    UnitMemlock,
)

HOST_FACTS = {
    "gpu": GpuInventory,
    "nvswitch": NvSwitchPresent,
    "fabric_manager": FabricManagerState,
    "kernel_module": NvidiaKernelModule,
    "rdma": RdmaDevices,
    "peermem": PeermemLoaded,
    "shm": ShmSize,
    "memlock": UnitMemlock,
    "disk": DiskFree,
    "os": OsRelease,
    "held_packages": HeldPackages,
}

__all__ = [
    "HOST_FACTS",
    "DiskFree",
    "FabricManagerState",
    "GpuInventory",
    "HeldPackages",
    "NvSwitchPresent",
    "NvidiaKernelModule",
    "OsRelease",
    "PeermemLoaded",
    "RdmaDevices",
    "ShmSize",
    "UnitMemlock",
]
