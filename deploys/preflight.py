"""Preflight stage: check every host's facts against the topology before anything changes.

    pyinfra inventory/lab.py deploys/preflight.py --data topology=topologies/h200-dsv32-tp8.yml

`--data preflight=hardware` checks only what provisioning cannot fix (GPU kind/count/MIG,
RDMA ports, free disk); the default (`full`) also requires the provisioned state (Fabric Manager
at the driver's version and active, peermem, shm size, memlock infinity for units) and the engine
runtimes: engine version, the P/D extras import (NIXL/UCX, Mooncake), the runtime's CUDA against
the driver's. Under deploys/site.py, what a later stage of the same run installs is not required.
Every `--data` key: `hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host

from hgxserve.deploy.plans import preflight_plan
from roles.preflight import preflight

plan = preflight_plan(host)
preflight(plan=plan)
