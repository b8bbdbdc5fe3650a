"""Provision stage: driver (and the nvidia module's IBGDA options where DeepEP spans hosts),
Fabric Manager, RDMA/UCX + peermem, /dev/shm, memlock, sysctl, and the host Python's venv
package (python3.X-venv, for the agent and the engine runtimes).

    pyinfra inventory/lab.py deploys/provision.py --data topology=topologies/h200-dsv32-tp8.yml

Runs the hardware preflight first (nothing changes on a host with the wrong GPUs). Optional
`--data` keys: `driver_version` (default hgxserve.topology.cuda.DRIVER_VERSION), `apt_source`
(an apt line for a local mirror instead of NVIDIA's CUDA repository), `fabric_manager`
(`auto`: only with NVSwitch, `always`, `never`), `load_now=false` (write boot config for
peermem and sysctl but do not load/apply it now), `remount_shm=false`. Booleans are
true/false, yes/no or 1/0; every key: `hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host

from hgxserve.deploy.plans import provision_plan
from roles.fabric_manager import fabric_manager
from roles.host_python import host_python
from roles.host_tuning import DEFAULT_SHM_SIZE, host_tuning
from roles.nvidia_driver import nvidia_driver
from roles.preflight import preflight
from roles.rdma import rdma

plan = provision_plan(host)
preflight(plan=plan.preflight)
# ibgda: DeepEP across hosts needs the nvidia module's IBGDA options (applied at reboot)
nvidia_driver(version=plan.driver_version, source=plan.apt_source, ibgda=plan.ibgda)
if plan.fabric_manager:
    fabric_manager(version=plan.driver_version, require_nvswitch=plan.require_nvswitch)
if plan.rdma:
    rdma(load_now=plan.load_now)
host_tuning(
    shm_size=plan.shm or DEFAULT_SHM_SIZE,
    remount_shm=plan.remount_shm,
    apply_sysctl=plan.load_now,
)
host_python()
