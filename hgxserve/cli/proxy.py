"""`hgxserve proxy serve|check`: run or validate the P/D proxy from its JSON configuration.

hgxserve proxy check --config /etc/hgxserve/proxy.json
hgxserve proxy serve --config /etc/hgxserve/proxy.json
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import click

from hgxserve.base.errors import HgxserveError, cli_errors
from hgxserve.proxy.config import load_proxy_config, read_api_key

config_option = click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Proxy configuration JSON (rendered from the topology).",
)


@click.group()
def proxy() -> None:
    """Run the P/D proxy (OpenAI-compatible endpoint)."""


@proxy.command()
@config_option
@cli_errors
def check(config_path: str) -> None:
    """Validate a proxy configuration file and say what it would route.

    \b
    hgxserve proxy check --config /etc/hgxserve/proxy.json
    """
    cfg = load_proxy_config(config_path)
    for key_file in (cfg.api_key_file, cfg.upstream_api_key_file, cfg.metrics_key_file):
        if key_file:
            read_api_key(key_file)
    click.echo(
        f"{config_path}: ok: {cfg.protocol} on {cfg.host}:{cfg.port}, model {cfg.served_model_name}"
    )
    for g in cfg.pd_groups:
        click.echo(
            f"  pd group {g.name}: prefill {', '.join(e.url for e in g.prefill)}"
            f" -> decode {', '.join(e.url for e in g.decode)}"
        )
    for e in cfg.combined:
        click.echo(f"  combined: {e.url}")
    threshold = cfg.routing.pd_min_prompt_tokens
    if cfg.pd_groups and cfg.combined and threshold:
        click.echo(f"  prompts >= {threshold} tokens go to P/D, shorter ones to combined")
    click.echo(
        f"  clients: {'key required' if cfg.api_key_file else 'no key (auth off)'}; "
        f"engines: {'keyed' if cfg.upstream_api_key_file else 'no key sent'}; "
        f"/metrics: {'key required' if cfg.metrics_key_file else 'open'}"
    )
    limits = cfg.limits
    click.echo(
        f"  front door: {limits.max_connections} connections, {limits.max_in_flight} requests in "
        f"flight, head within {limits.header_timeout_s:g} s, body within "
        f"{limits.body_timeout_s:g} s"
    )


@proxy.command()
@config_option
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
@cli_errors
def serve(config_path: str, log_level: str) -> None:
    """Serve the OpenAI-compatible endpoint until SIGTERM (which drains it first).

    SIGTERM: answer new requests 503 + Retry-After, let those in flight finish (up to
    limits.drain_timeout_s), exit; SIGUSR1: pause (the same refusal, keep running); SIGHUP:
    reload --config and admit again.

    \b
    hgxserve proxy serve --config /etc/hgxserve/proxy.json
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_proxy_config(config_path)
    try:
        from hgxserve.proxy.server import serve as run

        with contextlib.suppress(ImportError):
            import uvloop  # optional: a faster event loop when installed

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(run(cfg, config_path))
    except OSError as exc:
        raise HgxserveError(f"cannot listen: {exc}") from None
