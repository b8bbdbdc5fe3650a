"""Caches stage: give every engine on this host its baked JIT/compile cache (installs the
hgxserve agent first: the hosts run `hgxserve cache bake|restore`).

    pyinfra inventory/lab.py deploys/caches.py --data topology=topologies/h20-v4flash-tp8.yml \
        --data cache_store=/srv/hgxserve-caches
"""

import os

from pyinfra import host, inventory

from hgxserve.credfiles import secret_file
from hgxserve.deploying import (
    cache_entries,
    elect_bakers,
    env_secret_values,
    topology_file,
    topology_from_data,
)
from hgxserve.render import render_host
from roles.agent import agent
from roles.caches import caches

topology = topology_from_data(host)
store = host.data.get("cache_store") or os.path.expanduser("~/.cache/hgxserve/caches")

if topology.cache.policy != "off" and topology.engines_on(host.name):
    bakers = elect_bakers(topology, list(inventory.iter_activated_hosts()))

    agent()  # `hgxserve cache bake|restore` run on the host

    if host.name in bakers.values():
        # a bake starts the engine with its unit's secrets (a keyed engine's VLLM_API_KEY):
        # credentials from the controller's environment must be on the host before it
        rendered = render_host(topology, host.name).credentials
        pushed = env_secret_values({c.path: c.ref for c in rendered if c.path is not None})
        for path in sorted(pushed):
            secret_file(
                name=f"Install credential {path} for the bake (0600 in a 0700 directory)",
                dest=path,
                content=pushed[path],
            )

    caches(
        engines=cache_entries(topology, host),
        topology=topology_file(host),
        store=store,
        policy=topology.cache.policy,
        distribute=topology.cache.distribute,
        root=topology.cache.root,
        bakers=bakers,
    )
