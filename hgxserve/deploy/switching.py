"""Decisions the release and rollback deploys make once per run: every host's release plan,
the run's switch plan (which hosts switch: all of a topology's hosts switch together; the
evidence the gate checks), and the secret values the controller pushes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from pyinfra.api import DeployError
from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.base.runstate import per_run, recorded
from hgxserve.bench.scenario import kv_shapes
from hgxserve.facts.release import ReleaseState
from hgxserve.release.coordination import Coordination, RunPlan, needs_switch
from hgxserve.release.evidence import rdma_roles, unchecked_transport
from hgxserve.release.kvcap import kv_needs_by_host
from hgxserve.release.kvpath import kv_endpoints, kv_only_rails
from hgxserve.release.plan import HostRelease, plan_release
from hgxserve.topology import Topology
from hgxserve.topology.model import SecretRef


def require_all_reachable(all_hosts: list[Host], active: list[Host]) -> None:
    """All hosts switch together: with one unreachable, change nothing anywhere."""
    active_names = {h.name for h in active}
    lost = [h.name for h in all_hosts if h.name not in active_names]
    if lost:
        raise DeployError(
            f"host(s) {', '.join(lost)} is unreachable (or left out with --limit); nothing was "
            "changed on any host (all hosts of a topology switch together)"
        )


def release_plans(
    topo: Topology, hosts: list[Host], health_timeout_s: float | None
) -> dict[str, HostRelease]:
    """Every host's release for `topo`, rendered once per run (each host's deploy asks)."""
    key = ("release-plans", topo.digest, tuple(h.name for h in hosts), health_timeout_s)
    return per_run(
        _run(hosts),
        key,
        lambda: {
            h.name: plan_release(topo, h.name, health_timeout_s=health_timeout_s) for h in hosts
        },
    )


def _run(hosts: Sequence[Host]) -> State:
    if not hosts:
        raise DeployError("no host is active in this run")
    return hosts[0].state


def run_plan(
    states: Mapping[str, dict[str, Any]],
    targets: Mapping[str, str],
    topology: Topology | None = None,
) -> RunPlan:
    """The run's switch plan, decided before any host is touched, from each host's release
    state (the `ReleaseState` fact): the hosts whose state differs from the release id `targets`
    gives them (the topology's release, or a staged previous or baseline one) switch; with the
    release's `topology`, the RDMA and KV evidence the gate checks and the KV capacity the
    engines must hold (a rollback's plan has none)."""
    switching = {
        name: targets[name] for name, state in states.items() if needs_switch(state, targets[name])
    }
    if topology is None:
        return RunPlan(targets=targets, switching=switching)
    policy = topology.gate.kv_capacity
    return RunPlan(
        targets=targets,
        switching=switching,
        rdma_roles=rdma_roles(topology),
        # gate.rdma: off: what carried cross-host KV instead (TCP), said on confirm
        unchecked=unchecked_transport(topology),
        kv_endpoints=kv_endpoints(topology),
        kv_rails={name: r for name in states if (r := kv_only_rails(topology, name))},
        kv_policy=policy,
        kv_needs=(
            kv_needs_by_host(topology, kv_shapes(topology.source_file)) if policy != "off" else {}
        ),
    )


def plan_switch(
    key: str, hosts: Sequence[Host], targets: Mapping[str, str], topology: Topology | None = None
) -> Coordination:
    """The run's coordination: its plan (`run_plan`), made once per run whichever host's
    deploy asks first, and the record its hosts fill as the switch goes.

    pyinfra loads every host's deploy file side by side (a greenlet each), and reading a fact
    lets another host's load go on: the hosts' release states are read first, and the plan is
    then made and kept without a pause, so that every host gets the same one."""
    run, run_key = _run(hosts), ("coordination", f"{key}:{sorted(targets.items())}")
    planned: Coordination | None = recorded(run, run_key)
    if planned is not None:
        return planned
    states = {h.name: h.get_fact(ReleaseState) for h in hosts}  # may let another host plan
    return per_run(run, run_key, lambda: Coordination(run_plan(states, targets, topology)))


def secret_values(plan: HostRelease) -> dict[str, str]:
    """Values for credentials the controller pushes: only `env` references (read here)."""
    return env_secret_values(plan.secrets)


def env_secret_values(secrets: dict[str, SecretRef]) -> dict[str, str]:
    """host path -> value for the `env` references among `secrets` (read from the controller's
    environment); `file` and `credential` references are already on the host."""
    values = {}
    for path, ref in secrets.items():
        if ref.kind != "env":
            continue
        value = os.environ.get(ref.value)
        if value is None:
            raise DeployError(
                f"environment variable {ref.value} is not set on the controller "
                f"(the topology references it for {path})"
            )
        values[path] = value
    return values


def rollback_targets(hosts: list[Host], to: str) -> dict[str, str]:
    """Each host's `previous` or `baseline` release id; DeployError if any host lacks one."""
    if to not in ("previous", "baseline"):
        raise DeployError(f"--data to= must be previous or baseline, not {to!r}")
    targets: dict[str, str] = {}
    missing = []
    for h in hosts:
        state: dict[str, Any] = h.get_fact(ReleaseState)
        pending = state.get("pending")
        target = pending.get("previous") if to == "previous" and pending else state.get(to)
        if target is None:
            missing.append(h.name)
        else:
            targets[h.name] = target
    if missing:
        raise DeployError(f"no {to} release on: {', '.join(missing)}; nothing was changed")
    return targets
