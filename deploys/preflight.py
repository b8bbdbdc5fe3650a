"""Preflight stage: check every host's facts against the topology before anything changes.

    pyinfra inventory/lab.py deploys/preflight.py --data topology=topologies/h200-dsv32-tp8.yml

`--data preflight=hardware` checks only what provisioning cannot fix (GPU kind/count/MIG,
RDMA ports, free disk); the default also requires the provisioned state (Fabric Manager at
the driver's version and active, peermem, shm size, memlock infinity for units) and the engine
runtimes: engine version, the P/D extras import (NIXL/UCX, Mooncake), the runtime's CUDA against
the driver's. Under deploys/site.py, what a later stage of the same run installs is not required.
"""

from pyinfra import host
from pyinfra.api import DeployError

from hgxserve.deploying import topology_from_data
from hgxserve.facts.preflight import expectation_from_topology
from hgxserve.runtime.spec import RuntimeSpecError, container_images, venv_runtimes
from hgxserve.stages import in_site_run
from roles.nvidia_driver import DRIVER_VERSION
from roles.preflight import preflight

topology = topology_from_data(host)
if host.name not in topology.hosts:
    raise DeployError(
        f"{host.name}: not a host of topology {topology.name} "
        f"(hosts: {', '.join(sorted(topology.hosts))})"
    )
full = host.data.get("preflight", "full") != "hardware"
try:
    runtimes = venv_runtimes(topology, host.name, require_version=False) if full else []
except RuntimeSpecError as exc:
    detail = str(exc).replace("\n", "\n  ")
    raise DeployError(f"runtime: topology {topology.name}:\n  {detail}") from None
images = container_images(topology, host.name)
preflight(
    expect=expectation_from_topology(topology, host.name),
    after_provision=full,
    runtimes=tuple(runtimes),
    runtime_installs=in_site_run("runtime"),
    images=tuple(images) if full else (),
    planned_driver=str(host.data.get("driver_version", DRIVER_VERSION))
    if in_site_run("provision")
    else None,
)
