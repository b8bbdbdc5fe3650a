"""Monitoring stage: node exporter and NVIDIA's DCGM exporter on every host in use, Prometheus
(with the config, targets and rules `hgxserve monitoring render` writes) on the host the
topology's `monitoring.prometheus.host` names. A topology without `monitoring:` changes nothing
(render the drop-in files for an existing Prometheus with `hgxserve monitoring render`).

    pyinfra inventory/lab.py deploys/monitoring.py --data topology=topologies/h200-dsv32-2p1d.yml

Optional `--data container_tool=docker` for `dcgm_exporter.source: container` (default podman).
"""

from pyinfra import host, logger

from hgxserve.deploying import topology_from_data
from hgxserve.monitoring.host_files import host_monitoring
from roles.monitoring import monitoring

topology = topology_from_data(host)
part = host_monitoring(topology, host.name, str(host.data.get("container_tool", "podman")))
if part is None:
    why = "no monitoring: section" if topology.monitoring is None else "not a host in use"
    logger.info(f"{host.print_prefix}monitoring: nothing to do ({why} in {topology.name})")
else:
    monitoring(part=part)
