"""The whole path, per host and in order: preflight (facts vs topology) -> provision (driver,
fabric manager, RDMA/UCX, peermem, shm, memlock, sysctl) -> runtime (the engine venv or
container image, files the topology names) -> weights (sync + verify) -> caches (restore or
bake JIT caches) -> engines (release: stage, switch, gate, confirm or roll back) -> monitoring
(exporters, Prometheus and its rules, when the topology has a `monitoring:` section).

    pyinfra inventory/lab.py deploys/site.py --data topology=topologies/h20-v4flash-4p4d.yml
    pyinfra inventory/testhosts.py deploys/site.py --data topology=topologies/demo/demo-pd.yml \\
        --data stages=preflight,runtime,weights,engines

`--data stages=a,b` runs only those stages (in the order above); each is also its own deploy
file under deploys/. The stages' own keys pass through; every key: `hgxserve deploy-data`
(docs/deploy-data.md).
"""

from pyinfra import host, local

from hgxserve.deploy.plans import site_stages

for stage in site_stages(host):
    local.include(f"deploys/{stage}.py")
