"""Deploy-time helpers, the one library module the deploy files (deploys/*.py) take their logic
from: load the topology named by `--data topology=FILE`, decide per run which hosts switch,
resolve secret values, read cache key facts and elect one cache baker per key."""

from __future__ import annotations

import os
from typing import Any

from pyinfra.api import DeployError
from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.caches.key import cache_key
from hgxserve.caches.operations import CacheKeyFacts
from hgxserve.release.ops import Coordination, ReleaseState, coordination, needs_switch
from hgxserve.release.plan import HostRelease, plan_release
from hgxserve.runstate import per_run
from hgxserve.topology import Topology, TopologyError, load_topology
from hgxserve.topology.model import SecretRef


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


def topology_file(host: Host) -> str:
    """The topology file a deploy was given (`--data topology=FILE` or $HGXSERVE_TOPOLOGY)."""
    return str(host.data.get("topology") or os.environ.get("HGXSERVE_TOPOLOGY"))


def cache_entries(topo: Topology, host: Host) -> list[dict[str, Any]]:
    """Each engine on `host`: its cache key, and the full key with the host's facts (the
    engine venv's torch/CUDA/GPU build, read on the host) that decides who bakes."""
    entries = []
    for engine in topo.engines_on(host.name):
        venv = engine.runtime.venv if engine.runtime else None
        facts: dict[str, Any] = {}
        if venv:
            facts = host.get_fact(
                CacheKeyFacts,
                python=f"{venv.rstrip('/')}/bin/python",
                engine=engine.engine,
                manifest=f"{topo.model.path}/{topo.model.manifest}",
            )
        entries.append(
            {
                "engine": engine.name,
                "key": cache_key(topo, engine),
                "full_key": cache_key(topo, engine, host_facts=facts),
                "facts": facts,
                "multi_node": engine.is_multi_node,
            }
        )
    return entries


def elect_bakers(topo: Topology, active: list[Host]) -> dict[str, str]:
    """One baker per full cache key (GPU kind and host build included): the first host in
    topology order that needs the key; the others restore what it baked."""
    by_name = {h.name: h for h in active}
    bakers: dict[str, str] = {}
    for name in topo.hosts:
        if name in by_name:
            for entry in cache_entries(topo, by_name[name]):
                bakers.setdefault(entry["full_key"], name)
    return bakers
