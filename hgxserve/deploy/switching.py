"""Decisions the release and rollback deploys make once per run: every host's release plan,
which hosts switch (all of a topology's hosts switch together), and the secret values the
controller pushes."""

from __future__ import annotations

import os
from typing import Any

from pyinfra.api import DeployError
from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.base.runstate import per_run
from hgxserve.facts.release import ReleaseState
from hgxserve.release.coordination import Coordination, coordination, needs_switch
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


def _run(hosts: list[Host]) -> State:
    if not hosts:
        raise DeployError("no host is active in this run")
    return hosts[0].state


def plan_switch(key: str, hosts: list[Host], targets: dict[str, str]) -> Coordination:
    """Work out, once per run, which hosts switch: those whose state differs from the release
    id `targets` gives them (the topology's release, or a staged previous/baseline one)."""
    coord = coordination(_run(hosts), f"{key}:{sorted(targets.items())}")
    if coord.planned:
        return coord
    coord.targets = dict(targets)
    for h in hosts:
        if needs_switch(h.get_fact(ReleaseState), targets[h.name]):
            coord.switching[h.name] = targets[h.name]
    coord.planned = True
    return coord


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
