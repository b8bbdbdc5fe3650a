"""The proxy's routing policies (docs/proxy.md "KV-aware routing"), one module each behind
`Policy` (base.py), registered here under their names. The names, and what the topology knows
of each, are hgxserve/base/routing.py's; tests/structure/test_vocabularies.py keeps this
registry equal to them and to the schema's enum.

    policy = POLICIES["kv-events"](config.routing)
    policy.cached(plan, blocks, text)   # prompt tokens one engine holds of the request
"""

from __future__ import annotations

from hgxserve.proxy.policies.approximate import Approximate
from hgxserve.proxy.policies.base import Policy
from hgxserve.proxy.policies.kv_events import KvEvents
from hgxserve.proxy.policies.least_outstanding import LeastOutstanding

POLICIES: dict[str, type[Policy]] = {
    policy.vocab.name: policy
    for policy in (
        LeastOutstanding,
        Approximate,
        KvEvents,
    )
}
