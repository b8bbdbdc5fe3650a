"""Run the monitoring of a topology on one host: node exporter, NVIDIA's DCGM exporter and, on
the monitoring host, Prometheus with the rendered config, targets and rules.

Packages come from the host's apt sources at pinned versions (prometheus-node-exporter and
prometheus from the distribution's mirror; datacenter-gpu-manager-4-core and
datacenter-gpu-manager-exporter from NVIDIA's CUDA repository or the lab's mirror of it, which
the provision stage configures); nothing is downloaded from elsewhere. Each service restarts
only when its own files changed, Prometheus reloads (after `promtool check config` on the host)
only when its config or rules changed: a second run changes nothing.

Example:
    from hgxserve.monitoring.host_files import host_monitoring
    from roles.monitoring import monitoring
    monitoring(part=host_monitoring(topology, host.name))
"""

from __future__ import annotations

from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, server, systemd

from hgxserve.base.paths import (
    DCGM_COUNTERS,
    MONITORING_CONFIG_DIR,
    NODE_EXPORTER_DEFAULTS,
    PROMETHEUS_DEFAULTS,
    PROMETHEUS_DIR,
    PROMETHEUS_DROPIN,
    UNIT_DIR,
)
from hgxserve.deploy.switching import env_secret_values
from hgxserve.facts.files import FilesUnder
from hgxserve.monitoring.host_files import (
    DCGM_UNIT,
    NODE_EXPORTER_DROPIN,
    NODE_EXPORTER_PACKAGE,
    NODE_EXPORTER_UNIT,
    PROMETHEUS_PACKAGE,
    PROMETHEUS_UNIT,
    PROMETHEUS_USER,
    HostMonitoring,
)
from hgxserve.operations.credentials import secret_file
from hgxserve.operations.packages import APT_CACHE_SECONDS, pinned_packages


def _put(name: str, text: str, dest: str, mode: str = "644"):
    return files.put(name=name, src=StringIO(text), dest=dest, mode=mode, create_remote_dir=True)


def _converge(unit: str, what: str, changed: list, reload_units: bool) -> None:
    """daemon-reload when unit files changed, restart when the service's files changed, then
    keep it enabled and running."""
    if reload_units:
        systemd.daemon_reload(
            name=f"Reload systemd units for {what}",
            _if=lambda: any(op.did_change() for op in changed),
        )
    systemd.service(
        name=f"Restart {what} for its new configuration",
        service=unit,
        restarted=True,
        _if=lambda: any(op.did_change() for op in changed),
    )
    systemd.service(
        name=f"Keep {what} enabled and running", service=unit, running=True, enabled=True
    )


@deploy("Run monitoring exporters and Prometheus")
def monitoring(part: HostMonitoring, cache_time: int = APT_CACHE_SECONDS) -> None:
    """Install and run what `part` (hgxserve.monitoring.host_files.host_monitoring) says.

    + part: this host's exporters and Prometheus files
    + cache_time: seconds the apt lists count as fresh

    Example:
        monitoring(part=host_monitoring(topology, "hgx-c"))
    """
    if part.node_exporter_args is not None:
        pinned_packages(
            name="Install the Prometheus node exporter",
            packages=[NODE_EXPORTER_PACKAGE],
            cache_time=cache_time,
        )
        changed = [
            _put("Set the node exporter's listen address", part.node_exporter_args,
                 NODE_EXPORTER_DEFAULTS),
            _put("Sandbox the node exporter like hgxserve's units", NODE_EXPORTER_DROPIN,
                 f"{UNIT_DIR}/{NODE_EXPORTER_UNIT}.d/hgxserve.conf"),
        ]  # fmt: skip
        _converge(NODE_EXPORTER_UNIT, "the node exporter", changed, reload_units=True)
    if part.dcgm_unit is not None and part.dcgm_counters is not None:
        for package, version in part.dcgm_packages:
            pinned_packages(
                name=f"Install {package} {version}",
                packages=[package],
                version=version,
                hold=True,
                cache_time=cache_time,
            )
        if part.dcgm_unit.vendor_unit:
            systemd.service(
                name="Keep the package's own DCGM exporter unit stopped",
                service=part.dcgm_unit.vendor_unit,
                running=False,
                enabled=False,
            )
        changed = [
            files.directory(name="Create the monitoring config directory",
                            path=MONITORING_CONFIG_DIR, mode="755"),
            _put("Write the DCGM fields the exporter exports", part.dcgm_counters, DCGM_COUNTERS),
            _put("Write the DCGM exporter unit", part.dcgm_unit.text, f"{UNIT_DIR}/{DCGM_UNIT}"),
        ]  # fmt: skip
        _converge(DCGM_UNIT, "the DCGM exporter", changed, reload_units=True)
    if part.prometheus_args is not None:
        _prometheus(part, cache_time)


def _prometheus(part: HostMonitoring, cache_time: int) -> None:
    assert part.prometheus_args is not None
    pinned_packages(name="Install Prometheus", packages=[PROMETHEUS_PACKAGE], cache_time=cache_time)
    # before the config that names them (promtool checks the file is there); Prometheus reads
    # a key at every scrape, so a new one needs no reload
    for path, value in sorted(env_secret_values(part.prometheus_keys).items()):
        secret_file(
            name=f"Install the key Prometheus sends to the proxy's /metrics ({path}, 0640)",
            dest=path,
            content=value,
            group=PROMETHEUS_USER,
        )
    config = [
        _put(f"Write {path}", text, path) for path, text in sorted(part.prometheus_files.items())
    ]
    # targets and rules of a topology this Prometheus no longer runs for go with it
    dropin = f"{PROMETHEUS_DIR}/{PROMETHEUS_DROPIN}"
    found = host.get_fact(FilesUnder, path=dropin)
    for stale in sorted(set(found) - set(part.prometheus_files)):
        config.append(files.file(name=f"Remove stale {stale}", path=stale, present=False))
    args = _put("Set Prometheus' listen port and retention", part.prometheus_args,
                PROMETHEUS_DEFAULTS)  # fmt: skip
    # a config Prometheus would refuse never reaches it: check on the host, before any reload
    server.shell(
        name="Check the Prometheus config and rules with promtool",
        commands=[f"promtool check config {PROMETHEUS_DIR}/prometheus.yml"],
        _if=lambda: any(op.did_change() for op in config),
    )
    systemd.service(
        name="Restart Prometheus for its new arguments",
        service=PROMETHEUS_UNIT,
        restarted=True,
        _if=args.did_change,
    )
    systemd.service(
        name="Reload Prometheus for its new config and rules",
        service=PROMETHEUS_UNIT,
        reloaded=True,
        _if=lambda: not args.did_change() and any(op.did_change() for op in config),
    )
    systemd.service(
        name="Keep Prometheus enabled and running", service=PROMETHEUS_UNIT, running=True,
        enabled=True,
    )  # fmt: skip
