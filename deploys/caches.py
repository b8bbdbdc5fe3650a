"""Caches stage: give every engine on this host its baked JIT/compile cache.

    pyinfra inventory/lab.py deploys/caches.py --data topology=topologies/h20-v4flash-tp8.yml \
        --data cache_store=/srv/hgxserve-caches
"""

import os

from pyinfra import host, inventory

from hgxserve.caches.key import cache_key
from hgxserve.caches.operations import CacheKeyFacts
from hgxserve.topology import load_topology
from roles.caches import caches

topology_file = host.data.get("topology")
topology = load_topology(topology_file)
store = host.data.get("cache_store") or os.path.expanduser("~/.cache/hgxserve/caches")


def engine_entries(name: str) -> list[dict]:
    entries = []
    for engine in topology.engines_on(name):
        venv = engine.runtime.venv if engine.runtime else None
        facts = {}
        if venv:
            facts = inventory.get_host(name).get_fact(
                CacheKeyFacts,
                python=f"{venv.rstrip('/')}/bin/python",
                engine=engine.engine,
                manifest=f"{topology.model.path}/{topology.model.manifest}",
            )
        entries.append(
            {
                "engine": engine.name,
                "key": cache_key(topology, engine),
                "full_key": cache_key(topology, engine, host_facts=facts),
                "facts": facts,
            }
        )
    return entries


# One baker per (GPU kind, full key): the first host in topology order that needs the key.
bakers: dict[str, str] = {}
active = {h.name for h in inventory.iter_activated_hosts()}
for name in topology.hosts:
    if name in active:
        for entry in engine_entries(name):
            bakers.setdefault(entry["full_key"], name)

caches(
    engines=engine_entries(host.name),
    topology=topology_file,
    store=store,
    policy=topology.cache.policy,
    distribute=topology.cache.distribute,
    root=topology.cache.root,
    bakers=bakers,
)
