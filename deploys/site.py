"""The whole path, per host and in order: preflight (facts vs topology) -> provision (driver,
fabric manager, RDMA/UCX, peermem, shm, memlock, sysctl) -> runtime (the engine venv or
container image, files the topology names) -> weights (sync + verify) -> caches (restore or
bake JIT caches) -> engines (release: stage, switch, gate, confirm or roll back) -> monitoring
(exporters, Prometheus and its rules, when the topology has a `monitoring:` section).

    pyinfra inventory/lab.py deploys/site.py --data topology=topologies/h20-v4flash-4p4d.yml
    pyinfra inventory/testhosts.py deploys/site.py --data topology=topologies/demo/demo-pd.yml \\
        --data stages=preflight,runtime,weights,engines

`--data stages=a,b` runs only those stages (in the order above); each is also its own deploy
file under deploys/.
"""

from pyinfra import host, local
from pyinfra.api import DeployError

from hgxserve.stages import STAGES, requested_stages, set_site_stages

try:
    wanted = requested_stages(host.data.get("stages"))
except ValueError as exc:
    raise DeployError(str(exc)) from None
set_site_stages(wanted)

for stage in STAGES:
    if stage in wanted:
        local.include(f"deploys/{stage}.py")
