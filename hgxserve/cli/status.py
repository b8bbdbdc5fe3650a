"""`hgxserve status` and `hgxserve logs`: the operator's view of a deployed topology.

Both are read-only: on each host they run `hgxserve inspect` or `journalctl`, nothing else.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import click

from hgxserve.base.paths import AGENT
from hgxserve.status.report import EXIT_UNKNOWN

DEFAULT_INVENTORY = "inventory/lab.py"
# `hgxserve inspect` bounds each probe (nvidia-smi 15 s); this bounds the whole remote command
REMOTE_TIMEOUT_S = 30.0
DEFAULT_LOG_LINES = 200
DIAGNOSE_LOG_LINES = 5000

inventory_option = click.option(
    "--inventory",
    "-i",
    default=DEFAULT_INVENTORY,
    show_default=True,
    envvar="HGXSERVE_PYINFRA_INVENTORY",
    help="pyinfra inventory file whose hosts and SSH settings to use.",
)
connect_timeout_option = click.option(
    "--connect-timeout",
    type=click.FloatRange(0.5, 120),
    default=5.0,
    show_default=True,
    help="Seconds to wait for each host's SSH connection.",
)


def _fail(message: str) -> None:
    """Could not even start: say why, exit 2 (could not tell)."""
    click.echo(f"Error: {message}", err=True)
    sys.exit(EXIT_UNKNOWN)


def _topology(path: str) -> Any:
    from hgxserve.topology import TopologyError, load_topology

    try:
        return load_topology(path)
    except TopologyError as exc:
        _fail(f"invalid topology {path}:\n{exc}")
    except OSError as exc:
        _fail(f"{path}: {exc.strerror or exc}")


def _inventory(path: str, names: list[str]) -> Any:
    from hgxserve.remote.inventory import InventoryError, load_inventory

    try:
        return load_inventory(path).select(names)
    except InventoryError as exc:
        _fail(str(exc))


def _inventory_pinned(topo: Any, hosts: list[Any]) -> Any:
    """`topo` with its weights pinned from the inventory's pins file (`model_pins`), as the
    deploys pin them (so the expected release matches)."""
    from hgxserve.topology.trust import (
        TrustError,
        inventory_trust,
        load_pins,
        pinned,
        trust_root,
    )

    try:
        pins_file, _ = inventory_trust([h.data for h in hosts])
        pins = load_pins(pins_file) if pins_file else {}
        return pinned(topo, trust_root(topo.model, pins, pins_file or ""))
    except TrustError as exc:
        _fail(str(exc))


# ------------------------------------------------------------------------------- status


def gather(topo: Any, sessions: Any, agent: str, topology_file: str, digest: str | None) -> Any:
    """Run `hgxserve inspect` on every host at once and build the report."""
    from hgxserve.remote.ssh import quote_argv
    from hgxserve.status.report import build_report, inspect_argv

    started = time.monotonic()
    results = sessions.run_all(
        lambda name: quote_argv(inspect_argv(topo, name, agent)), REMOTE_TIMEOUT_S
    )
    return build_report(
        topo,
        topology_file,
        results,
        weights_digest=digest,
        elapsed_s=time.monotonic() - started,
    )


@click.command("status")
@click.argument("topology", type=click.Path(dir_okay=False))
@inventory_option
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
@click.option("--watch", "-w", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option(
    "--interval",
    type=click.FloatRange(0.5, 3600),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option(
    "--weights-digest",
    default=None,
    help="The manifest digest every host must be verified for, as given to the deploys "
    "(--data weights_digest=): the release is then the one deployed with that pin. Without "
    "it the hosts' markers must agree with each other.",
)
@click.option("--agent", default=AGENT, show_default=True, help="hgxserve on the hosts.")
@connect_timeout_option
def status(  # noqa: PLR0913 - a click command: one parameter per option
    topology: str,
    inventory: str,
    as_json: bool,
    watch: bool,
    interval: float,
    weights_digest: str | None,
    agent: str,
    connect_timeout: float,
) -> None:
    """Show what runs where for TOPOLOGY, and whether it is healthy and matches.

    Asks every host at once over SSH (one read-only `hgxserve inspect` each): releases and the
    pending switch with its revert deadline, each unit (active, health, restarts, since), drift
    from the release, GPU memory/utilisation and the engine holding each GPU, the weights marker,
    cache keys, and the proxy's rotation (which engine is out, and why), outstanding requests and
    KV hand-offs.

    Exit status: 0 healthy and matching the topology, 1 degraded (the problems say what),
    2 could not tell (a host unreachable or unable to answer).

    \b
    hgxserve status topologies/demo/demo-pd.yml --inventory inventory/testhosts.py
    hgxserve status t.yml --json | jq .problems
    hgxserve status t.yml --watch --interval 5
    """
    from hgxserve.remote.ssh import Sessions
    from hgxserve.status.table import render
    from hgxserve.topology.placement import pin_digest

    topo = _topology(topology)
    hosts = _inventory(inventory, list(topo.hosts))
    # the engines deploy pins the units the same way, so the expected release matches
    topo = pin_digest(_inventory_pinned(topo, hosts), weights_digest)
    code = EXIT_UNKNOWN
    with Sessions(hosts, connect_timeout=connect_timeout) as sessions:
        try:
            while True:
                report = gather(topo, sessions, agent, topology, weights_digest)
                code = report.exit_code
                text = report.to_json() if as_json else render(report, topo)
                if watch and sys.stdout.isatty():
                    click.clear()
                click.echo(text)
                if not watch:
                    break
                if not as_json:
                    click.echo(f"\n(every {interval:g} s; Ctrl-C to stop)")
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
    sys.exit(code)


# ------------------------------------------------------------------------------- logs


def log_hosts(topo: Any, target: str, host: str | None) -> tuple[str, list[str]]:
    """(unit name, hosts it runs on) for an engine name or `proxy`; click errors otherwise."""
    from hgxserve.render import unit_name

    if target == "proxy":
        if topo.proxy is None:
            raise click.BadParameter(f"topology {topo.name} has no proxy", param_hint="TARGET")
        unit, hosts = unit_name("proxy"), [topo.proxy.host]
    elif target in topo.engines:
        unit, hosts = unit_name(target), topo.engines[target].hosts
    else:
        choices = ", ".join(
            [*sorted(topo.engines), "proxy"] if topo.proxy else sorted(topo.engines)
        )
        raise click.BadParameter(f"{target!r} is not an engine of {topo.name} (one of: {choices})",
                                 param_hint="TARGET")  # fmt: skip
    if host is not None:
        if host not in hosts:
            raise click.BadParameter(
                f"{target} does not run on {host} (it runs on {', '.join(hosts)})",
                param_hint="--host",
            )
        hosts = [host]
    return unit, hosts


def _since(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.strip() or len(value) > 64 or any(ord(c) < 32 or c == "\x7f" for c in value):
        raise click.BadParameter(
            "a journalctl time: '10 min ago', '2026-11-30 08:00', 'today'", param_hint="--since"
        )
    return value


@click.command("logs")
@click.argument("topology", type=click.Path(dir_okay=False))
@click.argument("target", metavar="ENGINE|proxy")
@inventory_option
@click.option("--host", default=None, help="Only this host (of a multi-node engine).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
@click.option("--since", default=None, help="Only entries since: '10 min ago', '08:00', 'today'.")
@click.option(
    "--lines",
    "-n",
    type=click.IntRange(1, 1_000_000),
    default=None,
    help=f"Last N lines per host (default {DEFAULT_LOG_LINES}; all since --since when given).",
)
@click.option(
    "--diagnose",
    is_flag=True,
    help=f"Print the named causes of known failures found in the journal (last "
    f"{DIAGNOSE_LOG_LINES} lines per host) instead of the lines; exit 1 if any.",
)
@connect_timeout_option
def logs(  # noqa: PLR0913 - a click command: one parameter per option
    topology: str,
    target: str,
    inventory: str,
    host: str | None,
    follow: bool,
    since: str | None,
    lines: int | None,
    diagnose: bool,
    connect_timeout: float,
) -> None:
    """Print the journal of an engine's (or the proxy's) unit on every host it runs on.

    Lines are prefixed with the host (a multi-node engine runs one unit per host). With
    --diagnose, the known failure signatures (CUDA error 802, memlock, NIXL handshake, ...) found
    in the journal are printed with what they mean and the fix.

    Exit status: 0; with --diagnose 1 when a known failure was found; 2 when a host could not
    be read.

    \b
    hgxserve logs topologies/demo/demo-pd.yml decode-0 --since '10 min ago'
    hgxserve logs t.yml prefill-0 --host h200-b -f
    hgxserve logs t.yml decode-0 --diagnose
    """
    from hgxserve.remote.ssh import Sessions, quote_argv
    from hgxserve.status.journal import journal_argv

    if follow and diagnose:
        raise click.UsageError("--diagnose reads the journal once; it cannot --follow")
    since = _since(since)
    topo = _topology(topology)
    unit, names = log_hosts(topo, target, host)
    if lines is None and since is None:
        lines = DIAGNOSE_LOG_LINES if diagnose else DEFAULT_LOG_LINES
    units = [unit]
    if target in topo.engines and topo.engines[target].is_multi_node and not diagnose:
        # one failure domain: its watcher's events (down, restarts) among the engine's lines
        units.append(unit.removesuffix(".service") + "-watch.service")
    command = quote_argv(journal_argv(units, lines, since, follow))
    hosts = _inventory(inventory, names)
    width = max(len(n) for n in names)
    with Sessions(hosts, connect_timeout=connect_timeout) as sessions:
        if follow:
            sys.exit(_follow(sessions, command, width))
        results = sessions.run_all(command, REMOTE_TIMEOUT_S)
    code = 0
    found_any = False
    merged: list[tuple[str, str, str]] = []
    for name in names:
        result = results[name]
        if not result.ok or result.exit_status != 0:
            why = result.error or (result.stderr or result.stdout).strip()[-300:]
            click.echo(f"{name.ljust(width)} | cannot read the journal of {unit}: {why}", err=True)
            code = EXIT_UNKNOWN
            continue
        if diagnose:
            found_any |= _print_diagnosis(name, unit, result.stdout)
        else:
            merged += [(line[:24], name, line) for line in result.stdout.splitlines()]
    # the hosts' lines interleaved by time (short-iso: `2026-12-01T18:35:21+0000 ...`)
    for _, name, line in sorted(merged, key=lambda entry: entry[0]):
        click.echo(f"{name.ljust(width)} | {line}")
    if diagnose and code == 0 and found_any:
        code = 1
    sys.exit(code)


def _print_diagnosis(host: str, unit: str, text: str) -> bool:
    from hgxserve.parsers.outputs import diagnose_errors

    found = diagnose_errors(text)
    if not found:
        click.echo(f"{host}: {unit}: no known failure in the last {len(text.splitlines())} lines")
        return False
    for cause in found:
        click.echo(f"{host}: {unit}: {cause['code']}: {cause['diagnosis']}")
        click.echo(f"    {cause['line']}")
    return True


def _follow(sessions: Any, command: str, width: int) -> int:
    """Stream every host's journal at once, prefixed, until Ctrl-C (or all end)."""
    stop = threading.Event()
    lock = threading.Lock()
    failed: list[str] = []

    def on_line(host: str, line: str) -> None:
        with lock:
            click.echo(f"{host.ljust(width)} | {line}")

    def run(host: str) -> None:
        result = sessions.stream(host, command, on_line, stop)
        if not result.ok:
            failed.append(host)
            on_line(host, f"cannot follow the journal: {result.error}")

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in sessions.hosts]
    for thread in threads:
        thread.start()
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop.set()
        for thread in threads:
            thread.join(timeout=2)
    return EXIT_UNKNOWN if failed else 0
