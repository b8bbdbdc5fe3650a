"""Rules on the monitoring section: monitoring-* (monitoring-host).

Prometheus runs on a topology host, a container DCGM exporter names its image, and the proxy's
/metrics key is one the controller can hand Prometheus.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.model import Topology
from hgxserve.topology.registry import Finding, rule

FAMILY = ("monitoring-",)


@rule(
    "monitoring-host",
    "error",
    "monitoring: Prometheus runs on a topology host; a container DCGM exporter names its image; "
    "the proxy's /metrics key is one the controller can hand Prometheus (env).",
    why=(
        "Prometheus on an unknown host, or a container exporter without an image, deploys "
        "nothing; the controller reads a `file`/`credential` key nowhere to push it to "
        "Prometheus' host"
    ),
)
def monitoring_host(topo: Topology) -> Iterator[Finding]:
    mon = topo.monitoring
    if mon is None:
        return
    if mon.prometheus_host is not None and mon.prometheus_host not in topo.hosts:
        yield (
            ("monitoring", "prometheus", "host"),
            f"unknown host '{mon.prometheus_host}'; define it under hosts "
            f"(hosts are: {', '.join(topo.hosts)})",
        )
    if mon.dcgm_exporter and mon.dcgm_source == "container" and mon.dcgm_image is None:
        yield (
            ("monitoring", "dcgm_exporter", "source"),
            "source: container needs image: (nvcr.io/nvidia/k8s/dcgm-exporter@sha256:<digest>)",
        )
    key = topo.proxy.metrics_key if topo.proxy else None
    if mon.prometheus_host is not None and key is not None and key.kind != "env":
        yield (
            ("proxy", "auth", "metrics_key"),
            f"Prometheus on {mon.prometheus_host} scrapes the proxy with this key, which the "
            f"controller pushes to it from its environment: use metrics_key: {{env: NAME}} "
            f"(not {key.kind}:), or drop monitoring.prometheus.host and give an existing "
            "Prometheus the key yourself (docs/monitoring.md)",
        )
