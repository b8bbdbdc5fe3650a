"""pyinfra operations for releases: `switched`, and the topology-wide gate/settle steps
(python.call functions) that make all hosts switch together or not at all.

The run's shared `Coordination` is hgxserve.release.coordination: the steps read its frozen plan
and fill its record; the host's release store is read by the `ReleaseState` fact
(hgxserve.facts.release)."""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

from pyinfra.api import FunctionCommand, operation
from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.base.paths import AGENT, RELEASE_ROOT
from hgxserve.facts.release import ReleaseState
from hgxserve.release import CONFIRM_WITHIN_S, evidence, kvpath
from hgxserve.release.coordination import Coordination, final_state, needs_switch


def _run_streamed(state: State, host: Host, command: str) -> bool:
    """Run `command` on the host, printing its lines as they come: a switch waits minutes for
    real engines, and its progress lines (each engine's start phase) are the deploy's output."""
    ok, _ = host.run_shell_command(command, print_output=True)
    return bool(ok)


@operation()
def switched(
    release_id: str,
    confirm_within: int = CONFIRM_WITHIN_S,
    peers_within: int = 0,
    root: str = RELEASE_ROOT,
):
    """Switch the host to a staged release, pending confirmation.

    + release_id: the staged release to run
    + confirm_within: seconds, once every host switched, before the host reverts on its own
    + peers_within: seconds the other hosts may still take to switch (added to the first timer)

    **Example:**

    .. code:: python

        switched(name="Switch to the new release", release_id="3f1c9a2b7d10")
    """
    from pyinfra import host

    current = host.get_fact(ReleaseState, root=root)
    if not needs_switch(current, release_id):
        host.noop(f"release {release_id} is already current")
        return
    command = (
        f"{AGENT} release switch {shlex.quote(release_id)} --confirm-within {int(confirm_within)} "
        f"--peers-within {int(peers_within)} --defer-proxy --root {shlex.quote(root)}"
    )
    yield FunctionCommand(_run_streamed, (command,), {})


def _fail(host: Host, message: str) -> bool:
    host.log_styled(message, fg="red")
    return False


def _failed_switches(state: State, coord: Coordination) -> list[str]:
    """Hosts of this run's switch that pyinfra has marked failed (switch error, lost host)."""
    return sorted(h.name for h in state.failed_hosts if h.name in coord.plan.switching)


def note_moves(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call on every switching host before any switches: whether its switch stops or
    starts an engine, and whether an hgxserve proxy runs there (`hgxserve release moves`). A
    host that cannot say counts as moving its engines (a needless pause costs a few 503s)."""
    ok, output = host.run_shell_command(
        f"{AGENT} release moves {shlex.quote(release_id)} --root {shlex.quote(root)}"
    )
    try:
        found = json.loads("".join(output.stdout_lines)) if ok else {}
    except ValueError:
        found = {}
    coord.record.engines_move[host.name] = bool(found.get("engines", True))
    if found.get("proxies"):
        coord.record.proxy_hosts.add(host.name)
    return True


def pause_proxy(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call on every switching host, after `note_moves` and before any host switches:
    where the proxy runs and engines of *other* hosts will stop, pause it and wait until
    nothing is in flight, so no stream is cut when those engines stop (the host's own engines
    are the switch's own concern). `start_proxy` (or a rollback) reloads it."""
    record = coord.record
    others = sorted(h for h, move in record.engines_move.items() if move and h != host.name)
    if host.name not in record.proxy_hosts or not others:
        return True
    host.log_styled(f"engines on {', '.join(others)} will stop: pausing the proxy here first")
    return _run_streamed(state, host, f"{AGENT} release pause-proxy --root {shlex.quote(root)}")


def start_proxy(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call on every switched host once all of them switched: start the proxy the
    switch left stopped (or reload the one it left paused), so it admits engines only when
    all are healthy and warmed up."""
    failed = _failed_switches(state, coord)
    if failed:
        host.log_styled(f"proxy left stopped: host(s) {', '.join(failed)} failed to switch")
        return True
    return _run_streamed(
        state,
        host,
        f"{AGENT} release start-proxy {shlex.quote(release_id)} --root {shlex.quote(root)}",
    )


def _self_reverted(coord: Coordination) -> str | None:
    if not coord.record.reverted_on_own:
        return None
    names = ", ".join(sorted(coord.record.reverted_on_own))
    return f"host(s) {names} reverted on their own (dead-man timer) before the gate's verdict"


def arm_deadman(  # noqa: PLR0913 - pyinfra python.call: state and host first, then the run's
    state: State, host: Host, coord: Coordination, release_id: str, confirm_within: int, root: str
) -> bool:
    """python.call on every switched host once all of them switched (and again right after
    the gate): the dead-man timer counts `confirm_within` from now. A host that already
    reverted on its own is named, and the whole release then goes back."""
    if host.name in coord.record.reverted_on_own:
        return True  # said when it was found; settle fails this host
    ok, output = host.run_shell_command(
        f"{AGENT} release arm {shlex.quote(release_id)} --confirm-within {int(confirm_within)} "
        f"--root {shlex.quote(root)}"
    )
    lines = [line for line in (output.stdout_lines + output.stderr_lines) if line.strip()]
    if ok:
        host.log_styled(lines[-1] if lines else "dead-man timer re-armed", fg="blue")
        return True
    detail = " ".join(lines).removeprefix("Error: ").removeprefix("error: ")
    if "REVERTED ON ITS OWN" in detail:
        # named here; the host stays in the run so that settle reports it and reverts the rest
        coord.record.reverted_on_own[host.name] = f"{host.name} {detail}"
        host.log_styled(coord.record.reverted_on_own[host.name], fg="red")
        return True
    return _fail(host, f"{host.name}: {detail}")


def read_rdma_counters(  # noqa: PLR0913 - pyinfra python.call: state and host first
    state: State, host: Host, coord: Coordination, when: str, root: str, devices: list[str]
) -> bool:
    """python.call on the P/D hosts right before and right after the gate: their RDMA port
    counters (`when` is "before" or "after")."""
    ok, output = host.run_shell_command(evidence.counters_command(root, devices))
    counters = evidence.parse_counters(output.stdout_lines) if ok else {}
    record = coord.record
    (record.rdma_before if when == "before" else record.rdma_after)[host.name] = counters
    record.rdma_root = root
    host.log_styled(f"RDMA port counters {when} the gate: {len(counters)} read under {root}")
    return True


def read_kv_path(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call on the hosts of P/D engines whose KV crosses hosts, after the gate: the UCX
    protocol-selection tables each engine unit's current run logged (hgxserve.release.kvpath),
    kept for the verdict and, what they say, in the release's record on the host."""
    units = sorted({ep.unit for ep in coord.plan.kv_endpoints if ep.host == host.name})
    ok, output = host.run_shell_command(kvpath.journal_command(units))
    read = kvpath.parse_journal(output.stdout_lines) if ok else {}
    coord.record.kv_proto[host.name] = read
    said = ", ".join(
        f"{unit} {len(read[unit].tables)}"
        + ("" if read[unit].whole_run else " (its run started before the journal's oldest entry)")
        if unit in read
        else f"{unit} not read"
        for unit in units
    )
    host.log_styled(f"UCX protocol-selection tables of the KV engines' current run: {said}")
    record = {unit: kvpath.unit_record(read[unit]) for unit in units if unit in read}
    if record:
        ok, output = host.run_shell_command(
            f"{AGENT} release kv-transport {shlex.quote(release_id)} "
            f"--record {shlex.quote(json.dumps(record, sort_keys=True))} "
            f"--root {shlex.quote(root)}"
        )
        if not ok:
            why = " ".join(output.stderr_lines).removeprefix("Error: ")
            host.log_styled(f"KV transport not kept in the release's record: {why}", fg="yellow")
    return True


def _rdma_evidence(coord: Coordination) -> None:
    """Fail a passed gate whose P/D KV did not move over RDMA (once per run): the transport
    UCX selected for the KV endpoints first, the hosts' port counters as supporting evidence."""
    plan, record = coord.plan, coord.record
    if not (plan.rdma_roles or plan.kv_endpoints) or coord.transport_note is not None:
        return
    if record.verdict is None or not record.verdict[0]:
        return
    said: list[str] = []
    failed: list[str] = []
    if plan.kv_endpoints:
        ok, message = kvpath.transport_verdict(plan.kv_endpoints, record.kv_proto)
        (said if ok else failed).append(message)
    if plan.rdma_roles:
        ok, message = evidence.verdict(
            plan.rdma_roles, record.rdma_before, record.rdma_after, record.rdma_root
        )
        if plan.kv_rails:
            rails = "; ".join(f"{h} {','.join(d)}" for h, d in sorted(plan.kv_rails.items()))
            message += f" (the rails that carry only KV: {rails})"
        elif ok and failed:
            message += " (supporting only: the engines' own DP/EP traffic moves them too)"
        (said if ok else failed).append(message)
    record.rdma_note = "; ".join(failed + said)
    if failed:
        record.verdict = (False, f"gate failed: {record.rdma_note}")


def check_kv(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call on every switched host before the gate: the KV capacity its engines
    reported once healthy against what the topology's shapes need (`gate.kv_capacity`); the
    host keeps need, estimate and ratio in the release's record. A short engine fails the
    release with `fail` (the gate then names it), and is only said with `warn`."""
    policy, needs = coord.plan.kv_policy, coord.plan.kv_needs.get(host.name)
    if not needs or policy == "off" or _failed_switches(state, coord):
        return True
    need = json.dumps({unit: dict(fields) for unit, fields in needs.items()}, sort_keys=True)
    ok, output = host.run_shell_command(
        f"{AGENT} release kv-check {shlex.quote(release_id)} --need {shlex.quote(need)} "
        f"--policy {shlex.quote(policy)} --root {shlex.quote(root)}"
    )
    for line in output.stdout_lines:
        if line.strip():
            short = line.startswith("KV SHORT")
            loud = "red" if policy == "fail" else "yellow"
            host.log_styled(line, fg=loud if short else "blue")
    if not ok:
        detail = " ".join(output.stderr_lines).removeprefix("Error: ").strip()
        why = detail or "the KV capacity check failed"
        coord.record.kv_short[host.name] = f"{host.name}: {why}"
    return True


def _kv_verdict(coord: Coordination) -> tuple[bool, str] | None:
    """The failed verdict for engines whose KV capacity is below the shapes' need, if any."""
    short = coord.record.kv_short
    return (False, "; ".join(short[h] for h in sorted(short))) if short else None


def run_gate(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call: on the gate host, after every host switched: run the gate, keep the verdict."""
    failed, record = _failed_switches(state, coord), coord.record
    if failed or record.reverted_on_own:
        why = _self_reverted(coord) or f"host(s) {', '.join(failed)} failed to switch"
        record.verdict = (False, why)
        return True  # the gate itself did not fail; settle reports the reason on every host
    record.verdict = _kv_verdict(coord)
    if record.verdict is not None:
        host.log_styled(f"gate not run: {record.verdict[1]}", fg="red")
        return True
    ok, output = host.run_shell_command(
        f"{AGENT} release gate {shlex.quote(release_id)} --root {shlex.quote(root)}"
    )
    lines = [line for line in (output.stdout_lines + output.stderr_lines) if line.strip()]
    for line in lines:
        host.log_styled(line, fg="green" if ok else "red")
    record.verdict = (ok, lines[-1] if lines else ("gate passed" if ok else "gate failed"))
    return True


OWN_REVERT_POLL_S = 2.0  # how often the controller reads a self-reverting host's store
OWN_REVERT_SAY_EVERY_S = 30.0


def _host_release_state(host: Host, root: str) -> dict[str, Any] | None:
    """The host's ReleaseState, read now (None when the host cannot be read)."""
    fact = ReleaseState()
    ok, output = host.run_shell_command(fact.command(root=root))
    return fact.process(output.stdout_lines) if ok else None


def await_own_revert(host: Host, release_id: str, root: str, within_s: float) -> str:
    """After a host's dead-man timer fired: wait (up to `within_s`) until its revert has
    restarted the previous release's units and cleared its pending record; say where it ended.
    The controller must not exit while that host still restarts engines (minutes on GPUs)."""
    started = time.monotonic()
    said = started
    while True:
        release = _host_release_state(host, root)
        pending = (release or {}).get("pending")
        if release is not None and (pending is None or pending.get("id") != release_id):
            took = time.monotonic() - started
            end = final_state(release)
            return f"its own revert finished ({took:.0f}s after it was named); {end}"
        if time.monotonic() - started >= within_s:
            return (
                f"its own revert still runs after {within_s:.0f}s (pending {release_id}); "
                f"{final_state(release)}; see `hgxserve release status` and the journal there"
            )
        if time.monotonic() - said >= OWN_REVERT_SAY_EVERY_S:
            said = time.monotonic()
            host.log_styled(
                f"{host.name}: its own revert still restarts the previous release's units "
                f"({said - started:.0f}s, up to {within_s:.0f}s)"
            )
        time.sleep(OWN_REVERT_POLL_S)


def _verdict(coord: Coordination, own: str | None, failed: list[str]) -> tuple[bool, str]:
    """Confirm or revert, and why: a host's own revert, a failed switch, no gate, or the gate's."""
    if own:
        return (False, own)
    if failed:
        return (False, f"host(s) {', '.join(failed)} failed to switch")
    if coord.record.verdict is None:
        return (False, "the gate did not run (its host failed or was unreachable)")
    return coord.record.verdict


def settle(  # noqa: PLR0913 - pyinfra python.call passes state and host first, then the run's values
    state: State,
    host: Host,
    coord: Coordination,
    release_id: str,
    root: str,
    revert_within: float = 0,
) -> bool:
    """python.call on every switched host: confirm when the gate passed, else revert. A host
    that reverted on its own is waited for (up to `revert_within` seconds) until its revert
    has finished, and where it ended is reported."""
    failed = _failed_switches(state, coord)
    own = _self_reverted(coord)
    _rdma_evidence(coord)
    if host.name in coord.record.reverted_on_own:
        end = await_own_revert(host, release_id, root, revert_within)
        return _fail(host, f"{coord.record.reverted_on_own[host.name]}\n{host.name}: {end}")
    verdict = _verdict(coord, own, failed)
    q_id, q_root = shlex.quote(release_id), shlex.quote(root)
    if verdict[0]:
        ok, output = host.run_shell_command(f"{AGENT} release confirm {q_id} --root {q_root}")
        if not ok:
            detail = " ".join(output.stderr_lines).removeprefix("Error: ").removeprefix("error: ")
            return _fail(host, f"confirm failed on {host.name}: {detail}")
        if coord.transport_note:
            host.log_styled(coord.transport_note, fg="green")
        host.log_styled(f"release {release_id} confirmed", fg="green")
        return True
    ok, output = host.run_shell_command(f"{AGENT} release diagnose {q_id} --root {q_root}")
    for line in output.stdout_lines if ok else []:
        if line.startswith(("CAUSE", "NOTE")):
            host.log_styled(line, fg="red" if line.startswith("CAUSE") else "yellow")
    ok, output = host.run_shell_command(f"{AGENT} release revert {q_id} --root {q_root}")
    end = final_state(_host_release_state(host, root))
    if not ok:
        detail = " ".join(output.stderr_lines)
        return _fail(host, f"ROLLBACK FAILED ({detail}) after: {verdict[1]}\n{host.name}: {end}")
    return _fail(host, f"rolled back to the previous release: {verdict[1]}\n{host.name}: {end}")
