"""`hgxserve monitoring render TOPOLOGY -o DIR`: Prometheus config, targets, rules, dashboard.

$ hgxserve monitoring render topologies/demo/demo-pd.yml -o build/monitoring
demo-pd: 4 scrape jobs, 10 targets, 44 recording rules, 12 alerts, 31 dashboard queries
  build/monitoring/dcgm-exporter/dcgm-counters.csv
  ...
"""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from hgxserve.base.errors import Found, UsageError, cli_errors
from hgxserve.cli.options import topology_to_render
from hgxserve.monitoring.promtool import PROMTOOL, promtool_checks


@click.group()
def monitoring() -> None:
    """Monitoring rendered from the topology (Prometheus, rules, Grafana dashboard).

    \b
    hgxserve monitoring render topologies/demo/demo-pd.yml -o build/monitoring
    hgxserve monitoring render t.yml -o out --check     # and run promtool on the result
    """


@monitoring.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write prometheus/, grafana/ and dcgm-exporter/ into.")  # fmt: skip
@click.option("--check", is_flag=True,
              help="Run promtool check config / check rules on what was written.")  # fmt: skip
@cli_errors
def render(file: str, out_dir: str, check: bool) -> None:
    """Write the Prometheus config, file_sd targets, rules and Grafana dashboard of a topology.

    \b
    hgxserve monitoring render topologies/demo/demo-pd.yml -o build/monitoring
    hgxserve monitoring render topologies/h200-dsv32-2p1d.yml -o out --check

    For an existing Prometheus, copy prometheus/hgxserve/ to /etc/prometheus/hgxserve/ and add
    prometheus/hgxserve/scrape-configs.yml and the rule_files line to its config; for Grafana,
    provision grafana/dashboards/*.json (docs/monitoring.md).
    """
    from hgxserve.monitoring.dashboard import dashboard, queries
    from hgxserve.monitoring.render import render_tree, write_tree
    from hgxserve.monitoring.rules import rule_groups
    from hgxserve.monitoring.targets import scrape_targets, unreachable_engines

    topo = topology_to_render(file)
    tree = render_tree(topo)
    out = Path(out_dir)
    write_tree(out, tree)
    targets = scrape_targets(topo)
    groups = rule_groups(topo)
    recording = sum(1 for g in groups for r in g["rules"] if "record" in r)
    alerts = sum(1 for g in groups for r in g["rules"] if "alert" in r)
    click.echo(
        f"{topo.name}: {len({t.job for t in targets})} scrape jobs, {len(targets)} targets, "
        f"{recording} recording rules, {alerts} alerts, "
        f"{len(queries(dashboard(topo)))} dashboard queries"
    )
    for rel in tree:
        click.echo(f"  {out / rel}")
    for name in unreachable_engines(topo):
        click.echo(
            f"warning: engine {name} listens on loopback only: a Prometheus on another host "
            "cannot scrape it (set its bind:, or run Prometheus on its host)",
            err=True,
        )
    if check:
        _check(out)


def _check(out: Path) -> None:
    if shutil.which(PROMTOOL) is None:
        raise UsageError("--check needs promtool (Debian/Ubuntu package: prometheus)")
    failed = False
    for cmd, proc in promtool_checks(out):
        text = (proc.stdout + proc.stderr).strip()
        click.echo(f"$ {' '.join(cmd)}\n{text}")
        failed = failed or proc.returncode != 0
    if failed:
        raise Found("promtool found problems in the rendered files")
