"""Everything `hgxserve monitoring render` writes, as {relative path: text}, deterministically.

Layout (the `prometheus/` part mirrors /etc/prometheus on a host):

    prometheus/prometheus.yml                          a whole config (the monitoring host's)
    prometheus/hgxserve/scrape-configs.yml             the scrape jobs alone, for an existing one
    prometheus/hgxserve/file_sd/<topology>-<kind>.json targets with their labels (file_sd)
    prometheus/hgxserve/rules/<topology>.rules.yml     recording + alerting rules
    grafana/dashboards/hgxserve-<topology>.json        the dashboard
    grafana/provisioning/dashboards/hgxserve.yaml      Grafana file provider for it
    dcgm-exporter/dcgm-counters.csv                    the DCGM fields the exporter exports

>>> sorted(render_tree(topo))[0]  # doctest: +SKIP
'dcgm-exporter/dcgm-counters.csv'
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from hgxserve.base.paths import GRAFANA_DASHBOARDS_DIR, PROMETHEUS_DROPIN, prometheus_proxy_key
from hgxserve.monitoring.dashboard import dashboard
from hgxserve.monitoring.metrics import dcgm_counters_csv
from hgxserve.monitoring.rules import rule_groups
from hgxserve.monitoring.targets import JOB_PROXY, JOBS, Target, monitoring_of, scrape_targets
from hgxserve.topology.model import Topology

HEADER = "# Rendered by hgxserve from topology {name} (digest {digest}); do not edit here.\n"


def dump_yaml(data: Any) -> str:
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False  # type: ignore[assignment]
    yaml.width = 4096
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


def _kind(job: str) -> str:
    return job.removeprefix("hgxserve-")


def file_sd_name(topo: Topology, job: str) -> str:
    return f"{topo.name}-{_kind(job)}.json"


def rules_name(topo: Topology) -> str:
    return f"{topo.name}.rules.yml"


def file_sd(targets: list[Target], job: str) -> list[dict[str, Any]]:
    """file_sd groups of one job: one group per target (each has its own labels)."""
    return [
        {"targets": [t.address], "labels": {"job": job, **t.labels}}
        for t in targets
        if t.job == job
    ]


def scrape_configs(topo: Topology, targets: list[Target]) -> list[dict[str, Any]]:
    """One scrape job per kind of target that exists; job names are per topology (two
    topologies can share a Prometheus), the `job` label is the kind (`hgxserve-engine`)."""
    mon = monitoring_of(topo)
    interval = mon.scrape_interval_s
    out = []
    for job in JOBS:
        if not any(t.job == job for t in targets):
            continue
        config: dict[str, Any] = {
            "job_name": f"hgxserve-{topo.name}-{_kind(job)}",
            "scrape_interval": f"{interval}s",
            "scrape_timeout": f"{min(interval, 10)}s",
            "metrics_path": "/metrics",
        }
        if job == JOB_PROXY and proxy_metrics_keyed(topo):
            # Prometheus reads the file at every scrape; relative to its config, as file_sd
            config["authorization"] = {
                "type": "Bearer",
                "credentials_file": prometheus_proxy_key(topo.name),
            }
        config["file_sd_configs"] = [
            {"files": [f"{PROMETHEUS_DROPIN}/file_sd/{file_sd_name(topo, job)}"]}
        ]
        out.append(config)
    return out


def proxy_metrics_keyed(topo: Topology) -> bool:
    """Whether the topology's proxy wants a key on /metrics (hgxserve's own, metrics_key set)."""
    proxy = topo.proxy
    return proxy is not None and proxy.kind == "hgxserve" and proxy.metrics_key is not None


def prometheus_config(topo: Topology, targets: list[Target]) -> dict[str, Any]:
    mon = monitoring_of(topo)
    return {
        "global": {
            "scrape_interval": f"{mon.scrape_interval_s}s",
            "evaluation_interval": f"{mon.evaluation_interval_s}s",
        },
        "rule_files": [f"{PROMETHEUS_DROPIN}/rules/*.rules.yml"],
        "scrape_configs": scrape_configs(topo, targets),
    }


def grafana_provider() -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "hgxserve",
                "folder": "hgxserve",
                "type": "file",
                "disableDeletion": False,
                "updateIntervalSeconds": 60,
                "allowUiUpdates": False,
                "options": {"path": GRAFANA_DASHBOARDS_DIR, "foldersFromFilesStructure": False},
            }
        ],
    }


def render_tree(topo: Topology) -> dict[str, str]:
    """{path relative to the output dir: content} of everything the command writes."""
    targets = scrape_targets(topo)
    header = HEADER.format(name=topo.name, digest=topo.digest[:12])
    tree: dict[str, str] = {
        "prometheus/prometheus.yml": header + dump_yaml(prometheus_config(topo, targets)),
        "prometheus/hgxserve/scrape-configs.yml": (
            header
            + "# Add these to scrape_configs: of an existing Prometheus whose config lives in\n"
            + f"# /etc/prometheus, and '{PROMETHEUS_DROPIN}/rules/*.rules.yml' to rule_files:.\n"
            + dump_yaml(scrape_configs(topo, targets))
        ),
        f"prometheus/hgxserve/rules/{rules_name(topo)}": (
            header + dump_yaml({"groups": rule_groups(topo)})
        ),
        f"grafana/dashboards/hgxserve-{topo.name}.json": dump_json(dashboard(topo)),
        "grafana/provisioning/dashboards/hgxserve.yaml": dump_yaml(grafana_provider()),
        "dcgm-exporter/dcgm-counters.csv": dcgm_counters_csv(),
    }
    for job in JOBS:
        groups = file_sd(targets, job)
        if groups:
            tree[f"prometheus/hgxserve/file_sd/{file_sd_name(topo, job)}"] = dump_json(groups)
    return dict(sorted(tree.items()))


def write_tree(out: Path, tree: dict[str, str]) -> None:
    """Write `render_tree`'s files under `out`, each atomically (a reader never sees half)."""
    for rel, text in tree.items():
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
