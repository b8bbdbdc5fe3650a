"""What several commands share: click options declared once, and the few helpers that turn a
library's answer into output or an exit code the same way everywhere.

    @click.command()
    @api_key_file("File holding the proxy's API key, for the bench.")
    @METRICS_KEY_FILE
    def tune(api_key_file: str | None, metrics_key_file: str | None) -> None:
        key = read_api_key(api_key_file)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hgxserve.base.errors import ExitCode, Found, UsageError, register_secret

if TYPE_CHECKING:
    from hgxserve.topology.model import Topology

F = TypeVar("F", bound=Callable[..., Any])

# a file the command reads: it must exist
IN_FILE = click.Path(dir_okay=False, exists=True)

METRICS_KEY_FILE = click.option(
    "--metrics-key-file",
    type=IN_FILE,
    help="File holding the key the proxy's /metrics wants (proxy.auth.metrics_key).",
)


def api_key_file(help_text: str) -> Callable[[F], F]:
    """`--api-key-file`: the proxy's API key, read with `read_api_key` (never on argv)."""
    return click.option("--api-key-file", type=IN_FILE, help=help_text)


def round_timeout(help_text: str) -> Callable[[F], F]:
    """`--round-timeout`: seconds one bench round may take."""
    return click.option(
        "--round-timeout",
        type=click.FloatRange(1, 86400),
        default=3600,
        show_default=True,
        help=help_text,
    )


def runs_dir(default: str, what: str) -> Callable[[F], F]:
    """`--out`: the directory that keeps one folder per run (the parameter is `out_root`)."""
    return click.option(
        "--out",
        "out_root",
        default=default,
        show_default=True,
        type=click.Path(file_okay=False),
        help=f"Directory that keeps one folder per {what}.",
    )


def progress(message: str) -> None:
    """A long command's progress line, on stderr."""
    click.echo(message, err=True)


def dump_json(value: Any) -> None:
    """A command's JSON answer on stdout, indented, keys sorted."""
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def read_api_key(path: str | None) -> str | None:
    """The key in a key file: a private file with a full-length key (UsageError otherwise),
    registered as a secret (no message shows it)."""
    from hgxserve.base.apikeys import KeyFileError, read_key_file

    try:
        key = read_key_file(path) if path else None
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    register_secret(key)
    return key


@contextmanager
def topology_problems_exit() -> Iterator[None]:
    """A TopologyError raised inside prints each of its problems on stderr and exits 2."""
    from hgxserve.topology import TopologyError

    try:
        yield
    except TopologyError as exc:
        for problem in exc.problems:
            click.echo(problem.text(), err=True)
        sys.exit(ExitCode.USAGE)


def topology_to_render(path: str) -> Topology:
    """Check a topology a command renders from: print every problem to stderr, then return it.

    Raises UsageError (exit 2) when the file cannot be read or parsed, Found (exit 1) when the
    topology has errors; warnings are printed and do not stop it.
    """
    from hgxserve.topology import check_topology

    result = check_topology(path)
    for problem in result.problems:
        click.echo(problem.text(), err=True)
    if result.unreadable:
        raise UsageError(f"{path}: not rendered: the file cannot be read or parsed")
    if result.errors or result.topology is None:
        raise Found(f"{path}: not rendered: the topology has errors")
    return result.topology
