"""`hgxserve release`: the host side of releases (switch, confirm, revert, rollback, gate)."""

from __future__ import annotations

import json
import signal
import sys

import click

from hgxserve.errors import UsageError, cli_errors
from hgxserve.paths import RELEASE_ROOT
from hgxserve.release.gate import GateError, GateSpec, run_gate
from hgxserve.release.store import ReleaseError, Store, check_release_id
from hgxserve.release.switch import confirm, reconcile, revert, rollback_target, switch


def _store(root: str) -> Store:
    return Store(root)


def _log(message: str) -> None:
    # The controller may go away mid-switch (SSH dropped): keep going without a terminal, the
    # pending state and the dead-man timer decide what happens then.
    try:
        click.echo(message)
        sys.stdout.flush()
    except OSError:
        pass


root_option = click.option(
    "--root", default=RELEASE_ROOT, show_default=True, help="Release store directory."
)


@click.group()
def release() -> None:
    """Switch this host between staged releases (run on the host by the release deploy).

    \b
    hgxserve release status
    hgxserve release switch 3f1c9a2b7d10 --confirm-within 300
    hgxserve release confirm 3f1c9a2b7d10
    hgxserve release rollback --to baseline
    """


def _checked_id(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return check_release_id(value)
    except ReleaseError as exc:
        raise click.BadParameter(str(exc)) from None


@release.command()
@root_option
@cli_errors
def status(root: str) -> None:
    """Print links (current/previous/baseline), the pending switch and staged releases as JSON."""
    click.echo(json.dumps(_store(root).status(), sort_keys=True))


@release.command("switch")
@click.argument("release_id", callback=_checked_id)
@click.option(
    "--confirm-within",
    type=int,
    default=0,
    help="Leave the switch pending; revert it unless confirmed within this many seconds.",
)
@click.option("--gpu-timeout", type=float, default=300.0, show_default=True)
@root_option
@cli_errors
def switch_cmd(release_id: str, confirm_within: int, gpu_timeout: float, root: str) -> None:
    """Stop the running release, start RELEASE_ID, wait for health; roll back on failure."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # finish (or roll back) even if SSH drops
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    msg = switch(
        _store(root),
        release_id,
        confirm_within_s=confirm_within or None,
        gpu_timeout_s=gpu_timeout,
        log=_log,
    )
    _log(msg)


@release.command("confirm")
@click.argument("release_id", callback=_checked_id)
@root_option
@cli_errors
def confirm_cmd(release_id: str, root: str) -> None:
    """Make a pending switch current."""
    _log(confirm(_store(root), release_id))


@release.command("revert")
@click.argument("release_id", callback=_checked_id)
@root_option
@cli_errors
def revert_cmd(release_id: str, root: str) -> None:
    """Undo a pending switch to RELEASE_ID (the dead-man timer calls this too)."""
    _log(revert(_store(root), release_id, log=_log))


@release.command("rollback")
@click.option("--to", "to", default="previous", show_default=True, help="previous, baseline, an id")
@root_option
@cli_errors
def rollback_cmd(to: str, root: str) -> None:
    """Go back to the previous or baseline release on this host only (confirmed at once)."""
    store = _store(root)
    _log(switch(store, rollback_target(store, to), confirm_within_s=None, log=_log))


@release.command("gate")
@click.argument("release_id", callback=_checked_id)
@root_option
@cli_errors
def gate_cmd(release_id: str, root: str) -> None:
    """Run the topology's health gate described in RELEASE_ID's release.json."""
    spec = _store(root).load(release_id)
    if not spec.gate:
        raise UsageError(f"release {release_id} has no gate on this host")
    try:
        result = run_gate(GateSpec.from_dict(spec.gate), log=_log)
    except GateError as exc:
        raise GateError(f"gate failed: {exc}") from None
    _log("GATE-OK " + json.dumps(result, sort_keys=True))


@release.command("reconcile")
@root_option
@cli_errors
def reconcile_cmd(root: str) -> None:
    """At boot: revert an unconfirmed switch, reinstall and start the confirmed release."""
    _log(reconcile(_store(root), log=_log))
