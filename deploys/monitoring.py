"""Monitoring stage: node exporter and NVIDIA's DCGM exporter on every host in use, Prometheus
(with the config, targets and rules `hgxserve monitoring render` writes) on the host the
topology's `monitoring.prometheus.host` names. A topology without `monitoring:` changes nothing
(render the drop-in files for an existing Prometheus with `hgxserve monitoring render`).

    pyinfra inventory/lab.py deploys/monitoring.py --data topology=topologies/h200-dsv32-2p1d.yml

Optional `--data container_tool=docker` for `dcgm_exporter.source: container` (default podman).
Every key: `hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host

from hgxserve.deploy.plans import monitoring_plan
from roles.monitoring import monitoring

part = monitoring_plan(host)
if part is not None:
    monitoring(part=part)
