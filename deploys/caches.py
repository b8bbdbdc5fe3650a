"""Caches stage: give every engine on this host its baked JIT/compile cache (installs the
hgxserve agent first: the hosts run `hgxserve cache bake|restore`).

    pyinfra inventory/lab.py deploys/caches.py --data topology=topologies/h20-v4flash-tp8.yml \
        --data cache_store=/srv/hgxserve-caches
"""

import os

from pyinfra import host, inventory

from hgxserve.caches.key import cache_key
from hgxserve.caches.operations import CacheKeyFacts
from hgxserve.release.deploying import topology_from_data
from roles.agent import agent
from roles.caches import caches

topology = topology_from_data(host)
topology_file = str(host.data.get("topology") or os.environ.get("HGXSERVE_TOPOLOGY"))
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
if topology.cache.policy != "off" and topology.engines_on(host.name):
    active = {h.name for h in inventory.iter_activated_hosts()}
    for name in topology.hosts:
        if name in active:
            for entry in engine_entries(name):
                bakers.setdefault(entry["full_key"], name)

    agent()  # `hgxserve cache bake|restore` run on the host

    caches(
        engines=engine_entries(host.name),
        topology=topology_file,
        store=store,
        policy=topology.cache.policy,
        distribute=topology.cache.distribute,
        root=topology.cache.root,
        bakers=bakers,
    )
