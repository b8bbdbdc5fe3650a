"""What the monitoring stage writes on a host, rendered here (pure functions, tested without a
host): the DCGM exporter unit, the node exporter's ARGS and hardening drop-in, Prometheus' ARGS.

Pinned versions live here once: NVIDIA's DCGM exporter release pairs an exporter version with
the DCGM it was built against (NVIDIA/dcgm-exporter `hack/versions.env`: DCGM 4.6.0, exporter
4.8.3); the packages come from NVIDIA's CUDA repository, which the provision stage configures
(or the lab's mirror of it).

>>> node_exporter_args(9100).split()[0]
'ARGS="--web.listen-address=:9100'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hgxserve.base.paths import DCGM_COUNTERS
from hgxserve.base.units import exec_line, path_list
from hgxserve.monitoring.metrics import UNIT_INCLUDE
from hgxserve.render.types import CONTAINER_TOOLS, templates
from hgxserve.topology.model import Monitoring, SecretRef, Topology

DCGM_VERSION = "4.6.0"
DCGM_EXPORTER_VERSION = "4.8.3"
# (package, upstream version) installed for `source: package`, in install order
DCGM_PACKAGES = (
    ("datacenter-gpu-manager-4-core", DCGM_VERSION),
    ("datacenter-gpu-manager-exporter", DCGM_EXPORTER_VERSION),
)
DCGM_EXPORTER_BIN = "/usr/bin/dcgm-exporter"
DCGM_VENDOR_UNIT = "nvidia-dcgm-exporter.service"
DCGM_UNIT = "hgxserve-dcgm-exporter.service"
DCGM_CONTAINER = "hgxserve-dcgm-exporter"
NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
PROMETHEUS_PACKAGE = "prometheus"
PROMETHEUS_UNIT = "prometheus.service"
PROMETHEUS_USER = "prometheus"  # Debian's package runs Prometheus as this user and group

# Debian's node exporter unit runs as `prometheus` with no sandbox: ours, as for hgxserve's units.
# It reads /proc and /sys (read-only under ProtectSystem=strict) and netlink for netdev stats.
NODE_EXPORTER_DROPIN = """\
# Rendered by hgxserve (monitoring stage): the sandbox hgxserve's own units have.
[Service]
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
CapabilityBoundingSet=
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
Restart=on-failure
"""


@dataclass(frozen=True)
class DcgmUnit:
    text: str
    vendor_unit: str | None  # the package's own unit, kept stopped


def dcgm_exporter_unit(topo: Topology, mon: Monitoring, tool: str = "podman") -> DcgmUnit:
    """hgxserve-dcgm-exporter.service: the package's binary, or the pinned image run with
    `--pull=never` (loaded beforehand, as the runtime stage loads engine images)."""
    listen = f":{mon.dcgm_exporter_port}"
    if mon.dcgm_source == "container":
        assert mon.dcgm_image is not None  # the monitoring-host rule requires it
        binary = CONTAINER_TOOLS[tool]
        counters = "/etc/dcgm-exporter/hgxserve-counters.csv"
        argv = [
            binary, "run", "--rm", "--name", DCGM_CONTAINER, "--pull=never",
            "--network=host", "--cap-add=SYS_ADMIN",
            "--device=nvidia.com/gpu=all",
            f"--volume={DCGM_COUNTERS}:{counters}:ro",
            mon.dcgm_image, "-f", counters, "-a", listen,
        ]  # fmt: skip
        pre = [exec_line(["-" + binary, "rm", "-f", DCGM_CONTAINER])]
        stop = [exec_line([binary, "stop", "-t", "20", DCGM_CONTAINER])]
        vendor = None
        protect = "full"  # podman/docker write under /var/lib and /run
        read_write: list[str] = []
    else:
        argv = [DCGM_EXPORTER_BIN, "-f", DCGM_COUNTERS, "-a", listen]
        pre, stop = [], []
        vendor = DCGM_VENDOR_UNIT
        protect = "strict"
        read_write = [path_list(["/var/log"], optional=True)]
    text = (
        templates("monitoring")
        .get_template("dcgm-exporter.service.j2")
        .render(
            topology=topo.name,
            source=mon.dcgm_source,
            port=mon.dcgm_exporter_port,
            vendor_unit=vendor,
            after="nvidia-persistenced.service" if vendor else "",
            exec_start_pre=pre,
            exec_start=exec_line(argv),
            exec_stop=stop,
            protect_system=protect,
            read_write=read_write,
        )
    )
    return DcgmUnit(text, vendor)


def node_exporter_args(port: int) -> str:
    """/etc/default/prometheus-node-exporter (Debian's unit runs `$ARGS` from it): the listen
    port, and the systemd collector on hgxserve's units only (the engine-down alert tells a
    starting engine from a dead one by its unit's state)."""
    return (
        f'ARGS="--web.listen-address=:{int(port)} --collector.systemd '
        f'--collector.systemd.unit-include={UNIT_INCLUDE}"\n'
    )


def prometheus_args(mon: Monitoring) -> str:
    """/etc/default/prometheus: listen port and retention (the schema bounds both)."""
    return (
        f'ARGS="--web.listen-address=:{int(mon.prometheus_port)} '
        f'--storage.tsdb.retention.time={mon.retention}"\n'
    )


@dataclass(frozen=True)
class HostMonitoring:
    """This host's part of the monitoring stage (None fields: not on this host)."""

    node_exporter_args: str | None
    dcgm_unit: DcgmUnit | None
    dcgm_counters: str | None
    dcgm_packages: tuple[tuple[str, str], ...]
    prometheus_files: dict[str, str]  # host path -> content ({} when Prometheus runs elsewhere)
    prometheus_args: str | None
    # host path -> the proxy's /metrics key (rule monitoring-host: an env reference), which
    # the scrape job sends; pushed root:prometheus 0640 before promtool checks the config
    prometheus_keys: dict[str, SecretRef] = field(default_factory=dict)


def host_monitoring(topo: Topology, host: str, tool: str = "podman") -> HostMonitoring | None:
    """What `host` runs for the topology's `monitoring:`; None without one or off the topology.

    >>> host_monitoring(topo, "hgx-c").prometheus_args  # doctest: +SKIP
    'ARGS="--web.listen-address=:9090 --storage.tsdb.retention.time=1d"\\n'
    """
    from hgxserve.base.paths import PROMETHEUS_DIR, prometheus_proxy_key
    from hgxserve.monitoring.metrics import dcgm_counters_csv
    from hgxserve.monitoring.render import proxy_metrics_keyed, render_tree
    from hgxserve.monitoring.targets import gpu_hosts

    mon = topo.monitoring
    if mon is None:
        return None
    used = host in topo.hosts_in_use()
    runs_prometheus = mon.prometheus_host == host
    if not used and not runs_prometheus:
        return None
    dcgm = mon.dcgm_exporter and host in gpu_hosts(topo)
    prom_files: dict[str, str] = {}
    keys: dict[str, SecretRef] = {}
    if runs_prometheus and topo.proxy is not None and proxy_metrics_keyed(topo):
        assert topo.proxy.metrics_key is not None
        keys[f"{PROMETHEUS_DIR}/{prometheus_proxy_key(topo.name)}"] = topo.proxy.metrics_key
    if runs_prometheus:
        prefix = "prometheus/"
        prom_files = {
            f"{PROMETHEUS_DIR}/{rel.removeprefix(prefix)}": text
            for rel, text in render_tree(topo).items()
            if rel.startswith(prefix)
        }
    return HostMonitoring(
        node_exporter_args=(
            node_exporter_args(mon.node_exporter_port) if used and mon.node_exporter else None
        ),
        dcgm_unit=dcgm_exporter_unit(topo, mon, tool) if dcgm else None,
        dcgm_counters=dcgm_counters_csv() if dcgm else None,
        dcgm_packages=DCGM_PACKAGES if dcgm and mon.dcgm_source == "package" else (),
        prometheus_files=prom_files,
        prometheus_args=prometheus_args(mon) if runs_prometheus else None,
        prometheus_keys=keys,
    )
