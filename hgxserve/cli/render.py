"""`hgxserve render FILE --out DIR [--host NAME]`: write the tree each host will get.

$ hgxserve render topologies/h20-v4flash-4p4d.yml --out build/render
h20-a  3 units  4 files  tree 9cdc26667fcc
  /etc/hgxserve/proxy.json
  /etc/systemd/system/hgxserve-decode-0.service
  ...
"""

from __future__ import annotations

from pathlib import Path

import click

from hgxserve.base.errors import UsageError, cli_errors
from hgxserve.cli.options import topology_to_render
from hgxserve.render.tree import write_tree


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write DIR/<host>/<absolute path> into.")  # fmt: skip
@click.option("--host", "only_host", default=None, help="Render only this host.")
@cli_errors
def render(file: str, out_dir: str, only_host: str | None) -> None:
    """Write the systemd units and config files each host will get.

    \b
    hgxserve render topologies/h20-v4flash-4p4d.yml --out build/render
    hgxserve render topologies/h20-v4flash-4p4d.yml --out build/render --host h20-a
    """
    from hgxserve.render import RenderError, render_host

    topo = topology_to_render(file)
    hosts = topo.hosts_in_use()
    if only_host is not None:
        if only_host not in topo.hosts:
            raise UsageError(
                f"host {only_host!r} is not in {file} (hosts: {', '.join(topo.hosts)})"
            )
        hosts = [only_host]
    try:
        renders = [render_host(topo, host) for host in hosts]
    except RenderError as exc:
        raise RenderError(f"{file}: {exc}") from None
    for host_render in renders:
        paths = write_tree(Path(out_dir) / host_render.host, host_render)
        click.echo(
            f"{host_render.host}  {len(host_render.units)} units  {len(paths)} files  "
            f"tree {host_render.digest[:12]}"
        )
        for path in paths:
            click.echo(f"  {path}")
        for cred in host_render.credentials:
            source = f"{cred.ref.kind}:{cred.ref.value}"
            where = cred.path or "(on the host already)"
            click.echo(f"  credential {cred.name} <- {source} -> {where}")
