"""What one pyinfra run's switch shares across hosts, and how a host's release state reads.

A run's switch has two halves, kept together per run as a `Coordination`
(hgxserve.deploy.switching.plan_switch, hgxserve.base.runstate):

- the `RunPlan`, decided once before any host is touched: the release each host should run,
  which hosts switch, the hosts whose RDMA counters are evidence, the KV endpoints that cross
  hosts and the rails that carry only KV, the KV capacity policy and needs, and what nothing
  checks (`gate.rdma: off`). It is frozen, its collections read-only: no host's step can change
  what another host's step was planned with.
- the `RunRecord`, what the hosts report as the run goes: the gate's verdict, hosts that
  reverted on their own, the RDMA counters read around the gate and the KV transports UCX
  selected, engines short of KV capacity, whose engines move and where a proxy runs.

`needs_switch` and `final_state` read the value of the `ReleaseState` fact
(hgxserve.facts.release). Pure: the pyinfra steps that fill the record are
hgxserve.operations.release.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from hgxserve.release import evidence
from hgxserve.release.kvpath import KvEndpoint, UnitRead


def needs_switch(state: dict[str, Any], release_id: str) -> bool:
    """A host switches when the release is not current, a switch is left pending, or a unit
    of the current release is not running (the switch then only restarts what stopped)."""
    return (
        state.get("current") != release_id
        or state.get("pending") is not None
        or bool(state.get("inactive"))
    )


def frozen(value: Any) -> Any:
    """`value` made read-only all the way down: mappings as `MappingProxyType` over a copy,
    lists and tuples as tuples, sets as frozensets; anything else as it is.

    >>> plan = frozen({"hgx-a": ["mlx5_6"], "hgx-b": {"port_rcv_data"}})
    >>> plan["hgx-a"], plan["hgx-b"]
    (('mlx5_6',), frozenset({'port_rcv_data'}))
    >>> plan["hgx-c"] = ()
    Traceback (most recent call last):
    TypeError: 'mappingproxy' object does not support item assignment
    """
    if isinstance(value, Mapping):
        return MappingProxyType({key: frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    return value


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class RunPlan:
    """What one run's switch is planned with, before any host is touched (built once per run by
    hgxserve.deploy.switching.run_plan). Frozen: every collection is stored read-only (`frozen`),
    whatever was passed in; a rollback's plan names only its targets and who switches."""

    targets: Mapping[str, str] = field(default_factory=_empty)  # host -> release id to run
    switching: Mapping[str, str] = field(default_factory=_empty)  # the hosts that switch
    # host -> the RDMA port counters that must grow (sent/received) while the gate runs
    rdma_roles: Mapping[str, Collection[str]] = field(default_factory=_empty)
    # what carried cross-host KV that nothing checked (`gate.rdma: off`), said on confirm
    unchecked: str | None = None
    # the NIXL engines whose KV crosses hosts (their UCX tables are the KV path evidence)
    kv_endpoints: Sequence[KvEndpoint] = ()
    # host -> its RDMA devices that carry only KV (their counters are then the counter evidence)
    kv_rails: Mapping[str, Sequence[str]] = field(default_factory=_empty)
    # KV capacity (gate.kv_capacity): the policy, and host -> unit -> its KvNeed fields
    kv_policy: str = "off"
    kv_needs: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, frozen(getattr(self, f.name)))


@dataclass
class RunRecord:
    """What the hosts of one run's switch report as it goes (hgxserve.operations.release)."""

    verdict: tuple[bool, str] | None = None  # the gate's, once it ran (or why it did not)
    reverted_on_own: dict[str, str] = field(default_factory=dict)  # host -> what it said
    # the RDMA port counters read before and after the gate, and under which sysfs root
    rdma_root: str = evidence.RDMA_SYSFS
    rdma_before: dict[str, dict[str, int]] = field(default_factory=dict)
    rdma_after: dict[str, dict[str, int]] = field(default_factory=dict)
    # the KV transport evidence in words, once judged (hgxserve.operations.release)
    rdma_note: str | None = None
    # host -> unit -> the UCX protocol-selection tables each KV engine unit logged
    kv_proto: dict[str, dict[str, UnitRead]] = field(default_factory=dict)
    # host -> the message of a KV capacity below the shapes' need (fails the gate with `fail`)
    kv_short: dict[str, str] = field(default_factory=dict)
    # the proxy across the switch: host -> whether its switch stops or starts an engine, and
    # the hosts where an hgxserve proxy runs (paused first when other hosts' engines move)
    engines_move: dict[str, bool] = field(default_factory=dict)
    proxy_hosts: set[str] = field(default_factory=set)


@dataclass(frozen=True, eq=False)
class Coordination:
    """Shared by every host's deploy in one pyinfra run: the plan, and what the hosts report."""

    plan: RunPlan
    record: RunRecord = field(default_factory=RunRecord)

    @property
    def transport_note(self) -> str | None:
        """What a confirmed release says of how its KV crossed hosts: the evidence once judged,
        else what nothing checked (None: nothing to say)."""
        if self.record.rdma_note is not None:
            return self.record.rdma_note
        return self.plan.unchecked


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
