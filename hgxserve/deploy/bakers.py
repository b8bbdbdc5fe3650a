"""JIT cache baking at deploy time: each engine's cache key on a host (with the host's build
facts), and one baker per full key, elected once per run."""

from __future__ import annotations

from typing import Any

from pyinfra.api.host import Host

from hgxserve.caches.key import cache_key
from hgxserve.facts.caches import CacheKeyFacts
from hgxserve.topology import Topology


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
