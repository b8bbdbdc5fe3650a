"""`hgxserve deploy-data`: the `--data` keys the deploys read, from the one table
(`hgxserve.deploy.data.KEYS`), as text, JSON or the markdown of docs/deploy-data.md."""

from __future__ import annotations

import click

from hgxserve.deploy.datadoc import FORMATS


@click.command("deploy-data")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(sorted(FORMATS)),
    default="text",
    show_default=True,
    help="markdown: the page docs/deploy-data.md holds.",
)
def deploy_data(fmt: str) -> None:
    """Print every `--data` key the deploys read: type, default, stages, what it does."""
    click.echo(FORMATS[fmt](), nl=False)
