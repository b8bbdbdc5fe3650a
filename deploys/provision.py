"""Provision stage: driver, Fabric Manager, RDMA/UCX + peermem, /dev/shm, memlock, sysctl.

    pyinfra inventory/lab.py deploys/provision.py --data topology=topologies/h200-dsv32-tp8.yml

Runs the hardware preflight first (nothing changes on a host with the wrong GPUs). Optional
`--data` keys: `driver_version` (default roles.nvidia_driver.DRIVER_VERSION), `apt_source`
(an apt line for a local mirror instead of NVIDIA's CUDA repository), `fabric_manager`
(`auto`: only with NVSwitch, `always`, `never`), `load_now=false` (write boot config for
peermem and sysctl but do not load/apply it now), `remount_shm=false`.
"""

from pyinfra import host
from pyinfra.api import DeployError

from hgxserve.deploying import topology_from_data
from hgxserve.facts.preflight import expectation_from_topology
from roles.fabric_manager import fabric_manager
from roles.host_tuning import DEFAULT_SHM_SIZE, host_tuning
from roles.nvidia_driver import DRIVER_VERSION, nvidia_driver
from roles.preflight import preflight
from roles.rdma import rdma


def _flag(name: str, default: bool = True) -> bool:
    value = host.data.get(name, default)
    return value if isinstance(value, bool) else str(value).lower() not in ("0", "false", "no")


topology = topology_from_data(host)
if host.name not in topology.hosts:
    raise DeployError(
        f"{host.name}: not a host of topology {topology.name} "
        f"(hosts: {', '.join(sorted(topology.hosts))})"
    )
spec = topology.hosts[host.name]
version = str(host.data.get("driver_version", DRIVER_VERSION))
load_now = _flag("load_now")
fm_mode = str(host.data.get("fabric_manager", "auto"))

preflight(expect=expectation_from_topology(topology, host.name), after_provision=False)
nvidia_driver(version=version, branch=version.split(".")[0], source=host.data.get("apt_source"))
if fm_mode != "never":
    fabric_manager(version=version, require_nvswitch=fm_mode != "always")
if spec.rdma:
    rdma(load_now=load_now)
host_tuning(
    shm_size=spec.shm or DEFAULT_SHM_SIZE,
    remount_shm=_flag("remount_shm"),
    apply_sysctl=load_now,
)
