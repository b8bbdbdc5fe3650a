"""Deploy-time helpers shared by deploys/engines.py and deploys/rollback.py: load the topology
named by `--data topology=FILE`, decide per run which hosts switch, resolve secret values."""

from __future__ import annotations

import os
from typing import Any

from pyinfra.api import DeployError
from pyinfra.api.host import Host

from hgxserve.release.ops import Coordination, ReleaseState, coordination, needs_switch
from hgxserve.release.plan import HostRelease, plan_release
from hgxserve.topology import Topology, TopologyError, load_topology


def topology_from_data(host: Host) -> Topology:
    """The validated topology `--data topology=FILE` names; a clear DeployError otherwise."""
    path = host.data.get("topology") or os.environ.get("HGXSERVE_TOPOLOGY")
    if not path:
        raise DeployError("no topology given: pass --data topology=topologies/<name>.yml")
    try:
        return load_topology(path)
    except TopologyError as exc:
        raise DeployError(f"invalid topology {path}:\n{exc}") from None


def require_all_reachable(all_hosts: list[Host], active: list[Host]) -> None:
    """All hosts switch together: with one unreachable, change nothing anywhere."""
    active_names = {h.name for h in active}
    lost = [h.name for h in all_hosts if h.name not in active_names]
    if lost:
        raise DeployError(
            f"host(s) {', '.join(lost)} is unreachable (or left out with --limit); nothing was "
            "changed on any host (all hosts of a topology switch together)"
        )


_PLANS: dict[tuple[str, tuple[str, ...], float], dict[str, HostRelease]] = {}


def release_plans(
    topo: Topology, hosts: list[Host], health_timeout_s: float
) -> dict[str, HostRelease]:
    """Every host's release for `topo`, rendered once per run (each host's deploy asks)."""
    key = (topo.digest, tuple(h.name for h in hosts), health_timeout_s)
    if key not in _PLANS:
        _PLANS[key] = {
            h.name: plan_release(topo, h.name, health_timeout_s=health_timeout_s) for h in hosts
        }
    return _PLANS[key]


def plan_switch(key: str, hosts: list[Host], targets: dict[str, str]) -> Coordination:
    """Work out, once per run, which hosts switch: those whose state differs from the release
    id `targets` gives them (the topology's release, or a staged previous/baseline one)."""
    coord = coordination(f"{key}:{sorted(targets.items())}")
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
    values = {}
    for path, ref in plan.secrets.items():
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
