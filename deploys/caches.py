"""Caches stage: give every engine on this host its baked JIT/compile cache (installs the
hgxserve agent first: the hosts run `hgxserve cache bake|restore`).

    pyinfra inventory/lab.py deploys/caches.py --data topology=topologies/h20-v4flash-tp8.yml \
        --data cache_store=/srv/hgxserve-caches

`cache_store` is the controller's directory of baked caches (default ~/.cache/hgxserve/caches).
One host per full cache key bakes; it gets the credentials its engine units read from the
controller's environment first. Nothing runs with `cache.policy: off` or on a host without
engines. Every key: `hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host, inventory

from hgxserve.deploy.plans import caches_plan
from roles.agent import agent
from roles.caches import caches
from roles.credentials import bake_credentials
from roles.engine_user import engine_user

plan = caches_plan(host, inventory)
if plan.runs:
    agent()  # `hgxserve cache bake|restore` run on the host
    engine_user()  # a bake runs its engine as the units do; the caches are handed to the user
    bake_credentials(values=plan.bake_secrets)
    caches(plan=plan)
