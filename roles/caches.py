"""Restore (or bake once, then restore) the JIT/compile caches of this host's engines.

Distribution is controller-mediated: for each (GPU kind, full key) one host bakes, packs and its
archive is fetched into a store on the controller; every other host of that kind gets the
archive pushed and restored. Hosts whose restore marker already names the full key and archive
do nothing, so a second run reports zero changes.

Example:
    from roles.caches import caches
    caches(plan=caches_plan(host, inventory))  # hgxserve.deploy.plans, as deploys/caches.py does
    caches(engines=[{"engine": "decode-0", "key": k, "full_key": fk, "facts": f}],
           topology="topologies/t.yml", store="/srv/hgxserve-caches", bakers={fk: "h20-a"})
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import DeployError, deploy

from hgxserve.base.paths import AGENT
from hgxserve.deploy.plans import CachesPlan, plan_or_fields
from hgxserve.operations.caches import baked, restored, store_index


@deploy("Restore JIT caches")
def caches(*, plan: CachesPlan | None = None, agent: str = AGENT, **fields: Any) -> None:
    """Bring every engine's cache key directory on this host to its baked archive.

    + plan: the caches stage's plan (hgxserve.deploy.plans.caches_plan), or its fields as
      keywords instead:
      engines: one dict per engine on this host: engine, key (render-time), full_key, facts;
      topology: topology file on the controller (uploaded to the baker for `cache bake`);
      store: controller directory holding archives per full key;
      policy: off | restore (only restore archives that exist) | bake (bake missing ones) |
      auto (as bake, but a multi-node engine's missing cache is left to its first start);
      distribute: controller (s3 is not available yet); root: cache root on hosts;
      bakers: full key -> host that bakes it (one per GPU kind and key)
    + agent: hgxserve command on the hosts

    Example:
        caches(engines=[...], topology="t.yml", store="/srv/caches", policy="bake")
    """
    plan = plan_or_fields(plan, CachesPlan, fields)
    policy = plan.policy
    if policy == "off":
        return
    if plan.distribute != "controller":
        raise DeployError(
            f"cache distribution {plan.distribute!r} is not available yet; "
            "use distribute: controller"
        )
    seen: set[str] = set()
    for entry in plan.engines:
        key, full_key = entry["key"], entry["full_key"]
        if full_key in seen:  # prefill and decode with equal settings share one cache
            continue
        seen.add(full_key)
        in_store = store_index(plan.store, full_key) is not None
        if not in_store and policy == "auto" and entry.get("multi_node"):
            host.noop(
                f"no cache for {key} ({entry['engine']}) yet and none is baked: a multi-node "
                "bake needs every node of the engine started together; its first start compiles"
            )
            continue
        baking = policy in ("bake", "auto")
        what = f"JIT cache {key} ({entry['engine']})"
        if not in_store and baking and plan.bakers.get(full_key) == host.name:
            baked(
                name=f"Bake {what}",
                key=key,
                full_key=full_key,
                topology=plan.topology,
                engine=entry["engine"],
                facts=entry.get("facts") or {},
                root=plan.root,
                store=plan.store,
                agent=agent,
            )
        else:
            restored(
                name=f"Restore {what}",
                key=key,
                full_key=full_key,
                root=plan.root,
                store=plan.store,
                agent=agent,
            )
