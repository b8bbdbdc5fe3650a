"""`hgxserve release`: the host side of releases (switch, confirm, revert, rollback, gate)."""

from __future__ import annotations

import json
import signal
import sys

import click

from hgxserve.base.credstore import read_credential
from hgxserve.base.errors import UsageError, cli_errors
from hgxserve.base.paths import RELEASE_ROOT
from hgxserve.release.gate import GateError, GateSpec, run_gate
from hgxserve.release.store import ReleaseError, Store, check_release_id
from hgxserve.release.switch import (
    GPU_TIMEOUT_S,
    Systemd,
    arm,
    confirm,
    diagnosis,
    moves,
    pause_proxy,
    reconcile,
    revert,
    rollback_target,
    start_proxy,
    switch,
    wait_ready,
)


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
@click.option(
    "--peers-within",
    type=int,
    default=0,
    help="Seconds the other hosts may still take to switch: added to the first timer.",
)
@click.option(
    "--defer-proxy",
    is_flag=True,
    help="Leave the proxy stopped: `start-proxy` starts it once every host's engines are warm.",
)
@click.option("--gpu-timeout", type=float, default=GPU_TIMEOUT_S, show_default=True)
@root_option
@cli_errors
def switch_cmd(  # noqa: PLR0913 - a click command: one parameter per option
    release_id: str,
    confirm_within: int,
    peers_within: int,
    defer_proxy: bool,
    gpu_timeout: float,
    root: str,
) -> None:
    """Stop the running release, start RELEASE_ID, wait for health; roll back on failure."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # finish (or roll back) even if SSH drops
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    msg = switch(
        _store(root),
        release_id,
        confirm_within_s=confirm_within or None,
        peers_within_s=peers_within,
        defer_proxy=defer_proxy,
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


@release.command("start-proxy")
@click.argument("release_id", callback=_checked_id)
@root_option
@cli_errors
def start_proxy_cmd(release_id: str, root: str) -> None:
    """Start RELEASE_ID's proxy (left stopped by `switch --defer-proxy`), or reload it (left
    paused), and wait for it."""
    _log(start_proxy(_store(root), release_id, log=_log))


@release.command("moves")
@click.argument("release_id", callback=_checked_id)
@root_option
@cli_errors
def moves_cmd(release_id: str, root: str) -> None:
    """JSON: whether switching to RELEASE_ID stops or starts an engine here, and the hgxserve
    proxies running here (the controller pauses them when other hosts' engines move)."""
    click.echo(json.dumps(moves(_store(root), release_id), sort_keys=True))


@release.command("pause-proxy")
@root_option
@cli_errors
def pause_proxy_cmd(root: str) -> None:
    """Pause the hgxserve proxy running here (503 + Retry-After to new requests) and wait
    until nothing is in flight, at most its drain bound."""
    _log(pause_proxy(_store(root), log=_log))


@release.command("arm")
@click.argument("release_id", callback=_checked_id)
@click.option("--confirm-within", type=int, required=True, help="Seconds from now.")
@root_option
@cli_errors
def arm_cmd(release_id: str, confirm_within: int, root: str) -> None:
    """Re-arm the dead-man timer of the pending switch to RELEASE_ID (every host switched)."""
    _log(arm(_store(root), release_id, confirm_within))


@release.command("revert")
@click.argument("release_id", callback=_checked_id)
@click.option("--by-timer", is_flag=True, help="Called by the dead-man timer: record it.")
@root_option
@cli_errors
def revert_cmd(release_id: str, by_timer: bool, root: str) -> None:
    """Undo a pending switch to RELEASE_ID (the dead-man timer calls this too)."""
    _log(revert(_store(root), release_id, log=_log, by_timer=by_timer))


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


@release.command("kv-check")
@click.argument("release_id", callback=_checked_id)
@click.option(
    "--need",
    "needs",
    required=True,
    help='JSON: unit -> {"engine", "need_tokens", "shape", "dp", "fit_tokens"} (the deploy '
    "computes it from the topology's warm-up and bench shapes and the fit estimate).",
)
@click.option(
    "--policy",
    type=click.Choice(["fail", "warn"]),
    default="fail",
    show_default=True,
    help="gate.kv_capacity: fail exits 1 when an engine holds less than its shapes need.",
)
@root_option
@cli_errors
def kv_check_cmd(release_id: str, needs: str, policy: str, root: str) -> None:
    """Check the KV capacity each engine of RELEASE_ID reported once healthy against what the
    topology's shapes need; keep need, estimate and ratio in the release's record."""
    from hgxserve.release.kvcap import KvNeed, check_release

    try:
        parsed = {unit: KvNeed.from_dict(n) for unit, n in json.loads(needs).items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise UsageError(f"--need: not a unit -> need mapping: {exc}") from None
    short = check_release(_store(root), release_id, parsed, _log)
    if short and policy == "fail":
        click.echo(f"KV capacity below the topology's shapes: {'; '.join(short)}", err=True)
        sys.exit(1)


@release.command("kv-transport")
@click.argument("release_id", callback=_checked_id)
@click.option(
    "--record",
    required=True,
    help='JSON: unit -> {"kv_transport": "rdma|tcp|none", "kv_lanes": [...]} (what the UCX '
    "protocol-selection tables of the unit's current run say; the deploy reads them).",
)
@root_option
@cli_errors
def kv_transport_cmd(release_id: str, record: str, root: str) -> None:
    """Keep the transport UCX selected for each KV engine unit's endpoints to other hosts in
    RELEASE_ID's record (`observed`, shown by `status --json`)."""
    try:
        parsed = json.loads(record)
        fields = {
            unit: {"kv_transport": str(f["kv_transport"]), "kv_lanes": list(f["kv_lanes"])}
            for unit, f in parsed.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UsageError(f"--record: not a unit -> transport mapping: {exc}") from None
    store = _store(root)
    if not store.release_dir(release_id).is_dir():
        raise UsageError(f"release {release_id} is not staged under {root}")
    for unit, values in sorted(fields.items()):
        store.note_observed(release_id, unit, values)
        _log(f"{unit}: KV transport {values['kv_transport']} {', '.join(values['kv_lanes'])}")


@release.command("diagnose")
@click.argument("release_id", callback=_checked_id)
@root_option
@cli_errors
def diagnose_cmd(release_id: str, root: str) -> None:
    """Search the journals of RELEASE_ID's units (since its switch) for known failures and
    print each named cause with its fix, errors first (the deploy runs this when a gate fails)."""
    store = _store(root)
    spec = store.load(release_id)
    pending = store.pending() or {}
    since = pending.get("since") if pending.get("id") == release_id else None
    systemd = Systemd()
    found = [line for unit in spec.units for line in diagnosis(systemd, unit.name, since)]
    for line in sorted(found, key=lambda line: not line.startswith("CAUSE")):
        _log(line)
    if not found:
        _log(f"no known failure signature in the journals of {len(spec.units)} unit(s)")


@release.command("wait-ready")
@click.argument("url")
@click.option("--timeout", type=float, default=1800.0, show_default=True)
@click.option("--warmup", "shapes", help="Shapes to send once healthy: 128x64x8,4096x128x4:chat")
@click.option(
    "--api-key-credential",
    metavar="NAME[:PATH]",
    help="The engine's API key as its unit's LoadCredential= names it, sent as a Bearer token "
    "with the warm-up: read from $CREDENTIALS_DIRECTORY/NAME, else PATH, else the credential "
    "stores (/etc/credstore, /run/credstore, /usr/lib/credstore); never the key itself",
)
@cli_errors
def wait_ready_cmd(
    url: str, timeout: float, shapes: str | None, api_key_credential: str | None
) -> None:
    """Wait until URL (an engine's /health) answers 200, then send it the warm-up shapes: an
    engine unit's ExecStartPost=, so the unit is `activating` until the engine serves warm and
    TimeoutStartSec= bounds the whole start."""
    from hgxserve.caches.warmup import parse_shapes, warm_up

    try:
        plan = parse_shapes(shapes or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not wait_ready(url, timeout):
        raise ReleaseError(f"{url} did not answer 200 within {timeout:.0f}s")
    _log(f"{url} answers 200")
    if plan:
        api_key = read_credential(api_key_credential) if api_key_credential else None
        errors = warm_up(url.removesuffix("/health"), plan, _log, api_key=api_key)
        if errors:
            raise ReleaseError(f"warm-up failed: {'; '.join(errors[:3])}")
        _log(f"hgxserve warm-up done: {len(plan)} shape(s)")


@release.command("reconcile")
@root_option
@cli_errors
def reconcile_cmd(root: str) -> None:
    """At boot: revert an unconfirmed switch, reinstall and start the confirmed release."""
    _log(reconcile(_store(root), log=_log))


@click.group()
def engine() -> None:
    """Engines that span hosts, run as one failure domain (docs/releases.md).

    \b
    hgxserve engine watch --config /etc/hgxserve/watch/decode-0.json
    """


@engine.command("watch")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="The watcher's config from the release tree (/etc/hgxserve/watch/<engine>.json).",
)
@cli_errors
def watch_cmd(config_path: str) -> None:
    """Watch this host's part of a multi-node engine (run by its watcher unit): the head host's
    watcher restarts the whole engine when any member is down; the others restart their worker
    when it says so. Serves GET /state on the engine's watch_port."""
    from hgxserve.release.watch import WatchConfig, serve

    serve(WatchConfig.load(config_path))
