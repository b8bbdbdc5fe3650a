"""`hgxserve facts`: print this host's GPU/RDMA/shm/memlock facts as JSON, or parse captures.

Example:
    hgxserve facts --only gpu --only shm
    hgxserve facts parse topo /tmp/topo.txt
    journalctl -u hgxserve-decode-0 | hgxserve facts diagnose -
"""

from __future__ import annotations

import sys
from typing import Any

import click

from hgxserve.base.errors import ExitCode, UsageError, cli_errors
from hgxserve.cli.options import dump_json
from hgxserve.facts import HOST_FACTS
from hgxserve.facts.local import DEFAULT_MODEL_PATH, collect
from hgxserve.parsers import outputs as parsers

PARSERS = {
    "smi": parsers.parse_smi_table,
    "smi-list": parsers.parse_smi_list,
    "smi-query": parsers.parse_smi_query,
    "query-gpu": parsers.gpus_from_query,
    "compute-apps": parsers.parse_compute_apps,
    "topo": parsers.parse_topo_matrix,
    "nvlink": parsers.parse_nvlink_status,
    "ibv-devinfo": parsers.parse_ibv_devinfo,
    "ibstat": parsers.parse_ibstat,
    "ibdev2netdev": parsers.parse_ibdev2netdev,
}


@click.group(invoke_without_command=True)
@click.option(
    "--only",
    "only",
    multiple=True,
    type=click.Choice(sorted(HOST_FACTS)),
    help="Collect only these facts (repeatable).",
)
@click.option(
    "--model-path",
    default=DEFAULT_MODEL_PATH,
    show_default=True,
    help="Path whose filesystem the `disk` fact measures.",
)
@click.pass_context
def facts(ctx: click.Context, only: tuple[str, ...], model_path: str) -> None:
    """Print this host's facts (GPUs, NVSwitch, Fabric Manager, RDMA, shm, memlock...) as JSON.

    Example: hgxserve facts --only gpu --only fabric_manager
    """
    if ctx.invoked_subcommand is None:
        dump_json(collect(list(only) or None, model_path))


@facts.command("parse")
@click.argument("kind", type=click.Choice(sorted(PARSERS)))
@click.argument("capture", type=click.File("r"))
@cli_errors
def parse(kind: str, capture: Any) -> None:
    """Parse a saved tool output (KIND: smi, topo, ibv-devinfo, ...) and print it as JSON.

    Example: nvidia-smi topo -m | hgxserve facts parse topo -
    """
    text = capture.read()
    try:
        dump_json(PARSERS[kind](text))
    except ValueError as exc:
        raise UsageError(f"{capture.name}: not `{kind}` output: {exc}") from exc


@facts.command("diagnose")
@click.argument("log", type=click.File("r"))
def diagnose(log: Any) -> None:
    """Recognise known failures (CUDA 802, memlock, NIXL handshake) in a log; exit 1 if any.

    Example: journalctl -u hgxserve-decode-0 | hgxserve facts diagnose -
    """
    found = parsers.diagnose_errors(log.read())
    dump_json(found)
    if found:
        sys.exit(ExitCode.FOUND)
