"""The whole path, per host and in order: preflight (facts vs topology) -> provision (driver,
fabric manager, RDMA/UCX, peermem, shm, memlock, sysctl) -> weights (sync + verify) -> caches
(restore or bake JIT caches) -> engines (release: stage, switch, gate, confirm or roll back).

    pyinfra inventory/lab.py deploys/site.py --data topology=topologies/h20-v4flash-4p4d.yml
    pyinfra inventory/testhosts.py deploys/site.py --data topology=topologies/demo/demo-pd.yml \\
        --data stages=preflight,weights,engines

`--data stages=a,b` runs only those stages (in the order above); each is also its own deploy
file under deploys/.
"""

from pyinfra import host, local
from pyinfra.api import DeployError

STAGES = ("preflight", "provision", "weights", "caches", "engines")

requested = str(host.data.get("stages") or ",".join(STAGES))
wanted = [s.strip() for s in requested.split(",") if s.strip()]
unknown = [s for s in wanted if s not in STAGES]
if unknown:
    raise DeployError(f"unknown stage(s) {', '.join(unknown)}; stages are: {', '.join(STAGES)}")

for stage in STAGES:
    if stage in wanted:
        local.include(f"deploys/{stage}.py")
