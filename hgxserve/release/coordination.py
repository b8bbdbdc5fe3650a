"""What one pyinfra run's switch shares across hosts, and how a host's release state reads.

`Coordination` is kept once per run (hgxserve.base.runstate): who switches, the gate's verdict,
the RDMA evidence (port counters, the KV endpoints' UCX transports). `needs_switch` and
`final_state` read the value of the `ReleaseState` fact
(hgxserve.facts.release). Pure: the pyinfra steps that fill it are hgxserve.operations.release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hgxserve.base.runstate import per_run
from hgxserve.release import evidence
from hgxserve.release.kvpath import KvEndpoint, UnitRead

if TYPE_CHECKING:
    from pyinfra.api.state import State


def needs_switch(state: dict[str, Any], release_id: str) -> bool:
    """A host switches when the release is not current, a switch is left pending, or a unit
    of the current release is not running (the switch then only restarts what stopped)."""
    return (
        state.get("current") != release_id
        or state.get("pending") is not None
        or bool(state.get("inactive"))
    )


@dataclass
class Coordination:
    """Shared by every host's deploy in one pyinfra run: who switches, and the gate verdict."""

    targets: dict[str, str] = field(default_factory=dict)  # host -> release id it should run
    switching: dict[str, str] = field(default_factory=dict)  # hosts that switch in this run
    verdict: tuple[bool, str] | None = None
    planned: bool = False
    reverted_on_own: dict[str, str] = field(default_factory=dict)  # host -> what it said
    # RDMA evidence: host -> counters that must grow (sent/received), and the readings
    rdma_roles: dict[str, set[str]] = field(default_factory=dict)
    rdma_root: str = evidence.RDMA_SYSFS
    rdma_before: dict[str, dict[str, int]] = field(default_factory=dict)
    rdma_after: dict[str, dict[str, int]] = field(default_factory=dict)
    rdma_note: str | None = None
    # KV path evidence: the NIXL engines whose KV crosses hosts, and per host the UCX
    # protocol-selection tables each engine unit logged (hgxserve.release.kvpath)
    kv_endpoints: list[KvEndpoint] = field(default_factory=list)
    kv_proto: dict[str, dict[str, UnitRead]] = field(default_factory=dict)
    # host -> its RDMA devices that carry only KV (their counters are then the counter evidence)
    kv_rails: dict[str, list[str]] = field(default_factory=dict)
    # KV capacity (gate.kv_capacity): host -> unit -> KvNeed fields, the policy, and per host
    # the message of a capacity below the shapes' need (fails the gate with `fail`)
    kv_needs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    kv_policy: str = "off"
    kv_short: dict[str, str] = field(default_factory=dict)
    # the proxy across the switch: host -> whether its switch stops or starts an engine, and
    # the hosts where an hgxserve proxy runs (paused first when other hosts' engines move)
    engines_move: dict[str, bool] = field(default_factory=dict)
    proxy_hosts: set[str] = field(default_factory=set)


def coordination(state: State, key: str) -> Coordination:
    """The coordination named `key` in this pyinfra run (a new run gets a new one)."""
    return per_run(state, ("coordination", key), Coordination)


def final_state(release: dict[str, Any] | None) -> str:
    """One line for where a host ended: its current release, a pending switch, stopped units.

    >>> final_state({"current": "a1", "pending": None})
    'final state: current a1, nothing pending, every unit of it running'
    >>> final_state({"current": "a1", "pending": {"id": "b2"}, "inactive": ["hgxserve-x.service"]})
    'final state: current a1, switch to b2 still pending, not running: hgxserve-x.service'
    """
    if release is None:
        return "final state: unknown (the host's release store could not be read)"
    pending = release.get("pending")
    inactive = release.get("inactive") or []
    return (
        f"final state: current {release.get('current') or 'nothing'}, "
        + (f"switch to {pending.get('id')} still pending" if pending else "nothing pending")
        + (f", not running: {', '.join(inactive)}" if inactive else ", every unit of it running")
    )
