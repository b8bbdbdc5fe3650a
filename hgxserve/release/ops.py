"""pyinfra facts and operations for releases: `ReleaseState`, `release.switched`, and the
topology-wide gate/settle steps that make all hosts switch together or not at all."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase, operation
from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.paths import AGENT, RELEASE_ROOT
from hgxserve.runstate import per_run


class ReleaseState(FactBase[dict[str, Any]]):
    """Links and pending switch of the host's release store, read without the agent.

    Returns ``{"current": id, "previous": id, "baseline": id, "pending": {...}}`` (None if unset).
    """

    def command(self, root: str = RELEASE_ROOT) -> str:
        r = shlex.quote(root)
        return (
            f"for l in current previous baseline; do "
            f'id="$(basename "$(readlink {r}/$l 2>/dev/null)" 2>/dev/null)"; '
            f'printf "%s=%s\\n" "$l" "$id"; '
            f'if [ -n "$id" ] && grep -q \'"gate": {{\' {r}/$l/release.json 2>/dev/null; '
            f'then echo "gate_$l=yes"; fi; '
            f"done; printf 'pending='; cat {r}/pending.json 2>/dev/null | tr -d '\\n'; echo; "
            # units of the current release that are not running (drift: stopped, crashed)
            f'for u in $(sed -n \'s/^ *"name": "\\(hgxserve-[^"]*\\)",*$/\\1/p\' '
            f"{r}/current/release.json 2>/dev/null); do "
            f'systemctl is-active --quiet "$u" || echo "inactive=$u"; done'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        data: dict[str, Any] = {
            "current": None,
            "previous": None,
            "baseline": None,
            "pending": None,
        }
        for line in output:
            key, _, value = line.partition("=")
            if key in ("current", "previous", "baseline"):
                data[key] = value.strip() or None
            elif key.startswith("gate_"):
                data[key] = value.strip() == "yes"  # the release at that link runs the gate
            elif key == "pending" and value.strip():
                data["pending"] = json.loads(value)
            elif key == "inactive":
                data.setdefault("inactive", []).append(value.strip())
        return data


def needs_switch(state: dict[str, Any], release_id: str) -> bool:
    """A host switches when the release is not current, a switch is left pending, or a unit
    of the current release is not running (the switch then only restarts what stopped)."""
    return (
        state.get("current") != release_id
        or state.get("pending") is not None
        or bool(state.get("inactive"))
    )


@operation()
def switched(release_id: str, confirm_within: int = 300, root: str = RELEASE_ROOT):
    """Switch the host to a staged release, pending confirmation.

    + release_id: the staged release to run
    + confirm_within: seconds before the host reverts on its own unless confirmed

    **Example:**

    .. code:: python

        switched(name="Switch to the new release", release_id="3f1c9a2b7d10")
    """
    from pyinfra import host

    current = host.get_fact(ReleaseState, root=root)
    if not needs_switch(current, release_id):
        host.noop(f"release {release_id} is already current")
        return
    yield (
        f"{AGENT} release switch {shlex.quote(release_id)} --confirm-within {int(confirm_within)} "
        f"--root {shlex.quote(root)}"
    )


@dataclass
class Coordination:
    """Shared by every host's deploy in one pyinfra run: who switches, and the gate verdict."""

    targets: dict[str, str] = field(default_factory=dict)  # host -> release id it should run
    switching: dict[str, str] = field(default_factory=dict)  # hosts that switch in this run
    verdict: tuple[bool, str] | None = None
    planned: bool = False


def coordination(state: State, key: str) -> Coordination:
    """The coordination named `key` in this pyinfra run (a new run gets a new one)."""
    return per_run(state, ("coordination", key), Coordination)


def _fail(host: Host, message: str) -> bool:
    host.log_styled(message, fg="red")
    return False


def _failed_switches(state: State, coord: Coordination) -> list[str]:
    """Hosts of this run's switch that pyinfra has marked failed (switch error, lost host)."""
    return sorted(h.name for h in state.failed_hosts if h.name in coord.switching)


def run_gate(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call: on the gate host, after every host switched: run the gate, keep the verdict."""
    failed = _failed_switches(state, coord)
    if failed:
        coord.verdict = (False, f"host(s) {', '.join(failed)} failed to switch")
        return True  # the gate itself did not fail; settle reports the reason on every host
    ok, output = host.run_shell_command(
        f"{AGENT} release gate {shlex.quote(release_id)} --root {shlex.quote(root)}"
    )
    lines = [line for line in (output.stdout_lines + output.stderr_lines) if line.strip()]
    for line in lines:
        host.log_styled(line, fg="green" if ok else "red")
    coord.verdict = (ok, lines[-1] if lines else ("gate passed" if ok else "gate failed"))
    return True


def settle(state: State, host: Host, coord: Coordination, release_id: str, root: str) -> bool:
    """python.call on every switched host: confirm when the gate passed, else revert."""
    failed = _failed_switches(state, coord)
    if failed:
        verdict = (False, f"host(s) {', '.join(failed)} failed to switch")
    elif coord.verdict is None:
        verdict = (False, "the gate did not run (its host failed or was unreachable)")
    else:
        verdict = coord.verdict
    q_id, q_root = shlex.quote(release_id), shlex.quote(root)
    if verdict[0]:
        ok, output = host.run_shell_command(f"{AGENT} release confirm {q_id} --root {q_root}")
        if not ok:
            return _fail(host, f"confirm failed: {' '.join(output.stderr_lines)}")
        host.log_styled(f"release {release_id} confirmed", fg="green")
        return True
    ok, output = host.run_shell_command(f"{AGENT} release revert {q_id} --root {q_root}")
    if not ok:
        detail = " ".join(output.stderr_lines)
        return _fail(host, f"ROLLBACK FAILED ({detail}) after: {verdict[1]}")
    return _fail(host, f"rolled back to the previous release: {verdict[1]}")
