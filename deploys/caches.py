"""Caches stage: give every engine on this host its baked JIT/compile cache (installs the
hgxserve agent first: the hosts run `hgxserve cache bake|restore`).

    pyinfra inventory/lab.py deploys/caches.py --data topology=topologies/h20-v4flash-tp8.yml \
        --data cache_store=/srv/hgxserve-caches
"""

import os

from pyinfra import host, inventory

from hgxserve.deploying import cache_entries, elect_bakers, topology_file, topology_from_data
from roles.agent import agent
from roles.caches import caches

topology = topology_from_data(host)
store = host.data.get("cache_store") or os.path.expanduser("~/.cache/hgxserve/caches")

if topology.cache.policy != "off" and topology.engines_on(host.name):
    bakers = elect_bakers(topology, list(inventory.iter_activated_hosts()))

    agent()  # `hgxserve cache bake|restore` run on the host

    caches(
        engines=cache_entries(topology, host),
        topology=topology_file(host),
        store=store,
        policy=topology.cache.policy,
        distribute=topology.cache.distribute,
        root=topology.cache.root,
        bakers=bakers,
    )
