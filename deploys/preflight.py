"""Preflight stage: check every host's facts against the topology before anything changes.

    pyinfra inventory/lab.py deploys/preflight.py --data topology=topologies/h200-dsv32-tp8.yml

`--data preflight=hardware` checks only what provisioning cannot fix (GPU kind/count/MIG,
RDMA ports, free disk); the default also requires the provisioned state (Fabric Manager at
the driver's version and active, peermem, shm size, memlock infinity for units).
"""

from pyinfra import host
from pyinfra.api import DeployError

from hgxserve.facts.preflight import expectation_from_topology
from hgxserve.release.deploying import topology_from_data
from roles.preflight import preflight

topology = topology_from_data(host)
if host.name not in topology.hosts:
    raise DeployError(
        f"{host.name}: not a host of topology {topology.name} "
        f"(hosts: {', '.join(sorted(topology.hosts))})"
    )
preflight(
    expect=expectation_from_topology(topology, host.name),
    after_provision=host.data.get("preflight", "full") != "hardware",
)
