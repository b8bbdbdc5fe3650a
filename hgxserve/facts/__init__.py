"""pyinfra facts (FactBase classes), one module per concern, as pyinfra lays out its own: `gpu`,
`host`, `runtime`, `caches`, `weights`, `release`, `files`. What their commands print is parsed
by pure functions in hgxserve.parsers; the operations that read them are hgxserve.operations.

`HOST_FACTS` maps the short names used in `hgxserve facts` JSON and in preflight checks to the
pyinfra fact classes, so the controller and the host read the same commands the same way.

The fact classes are imported on first use: `hgxserve.facts.preflight` alone (the pure
comparison of facts with a topology) does not pay for importing pyinfra (~1 s).

Example:
    >>> from hgxserve.facts import HOST_FACTS
    >>> sorted(HOST_FACTS)[:3]
    ['disk', 'fabric_manager', 'gpu']
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hgxserve.facts.gpu import (
        FabricManagerState,
        GpuInventory,
        NvidiaKernelModule,
        NvSwitchPresent,
    )
    from hgxserve.facts.host import (
        DiskFree,
        HeldPackages,
        HostResources,
        OsRelease,
        PeermemLoaded,
        RdmaDevices,
        ShmSize,
        UnitMemlock,
    )

    HOST_FACTS: dict[str, Any]

# fact class name -> module that defines it
_FACT_MODULES = {
    "GpuInventory": "hgxserve.facts.gpu",
    "NvSwitchPresent": "hgxserve.facts.gpu",
    "FabricManagerState": "hgxserve.facts.gpu",
    "NvidiaKernelModule": "hgxserve.facts.gpu",
    "RdmaDevices": "hgxserve.facts.host",
    "PeermemLoaded": "hgxserve.facts.host",
    "ShmSize": "hgxserve.facts.host",
    "UnitMemlock": "hgxserve.facts.host",
    "DiskFree": "hgxserve.facts.host",
    "HostResources": "hgxserve.facts.host",
    "OsRelease": "hgxserve.facts.host",
    "HeldPackages": "hgxserve.facts.host",
}
# short name -> fact class name
_HOST_FACT_NAMES = {
    "gpu": "GpuInventory",
    "nvswitch": "NvSwitchPresent",
    "fabric_manager": "FabricManagerState",
    "kernel_module": "NvidiaKernelModule",
    "rdma": "RdmaDevices",
    "peermem": "PeermemLoaded",
    "shm": "ShmSize",
    "memlock": "UnitMemlock",
    "disk": "DiskFree",
    "resources": "HostResources",
    "os": "OsRelease",
    "held_packages": "HeldPackages",
}


def __getattr__(name: str) -> Any:
    if name == "HOST_FACTS":
        value: Any = {short: __getattr__(cls) for short, cls in _HOST_FACT_NAMES.items()}
    elif name in _FACT_MODULES:
        value = getattr(importlib.import_module(_FACT_MODULES[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "HOST_FACTS",
    "DiskFree",
    "FabricManagerState",
    "GpuInventory",
    "HeldPackages",
    "HostResources",
    "NvSwitchPresent",
    "NvidiaKernelModule",
    "OsRelease",
    "PeermemLoaded",
    "RdmaDevices",
    "ShmSize",
    "UnitMemlock",
]
