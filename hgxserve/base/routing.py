"""The hgxserve proxy's routing policies by name (docs/proxy.md "KV-aware routing"): the one
place in Python their names are written, with what the topology needs to know of each without
the proxy's code. What each does is the proxy's (`hgxserve/proxy/policies/`, one module each,
registered under these names); tests/structure/test_vocabularies.py keeps the names, in order,
equal to the schema's `$defs.routingPolicy` enum and to the proxy's registry.

>>> POLICY_NAMES
('least-outstanding', 'approximate', 'kv-events')
>>> is_kv_aware("approximate"), reads_kv_events("approximate")
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyName:
    """A routing policy's name and what the topology knows of it."""

    name: str
    # it routes by the prompt prefixes the engines hold cached: on such a vLLM P/D route a decode
    # prefills a prompt itself when few of its tokens are uncached there (route `pd-local`)
    kv_aware: bool
    # the engines it routes to publish their KV cache events for it (one port per DP rank)
    kv_events: bool = False


LEAST_OUTSTANDING = PolicyName("least-outstanding", kv_aware=False)
APPROXIMATE = PolicyName("approximate", kv_aware=True)
KV_EVENTS = PolicyName("kv-events", kv_aware=True, kv_events=True)
# every policy, by name, in the schema's enum order
VOCABULARY: dict[str, PolicyName] = {
    policy.name: policy
    for policy in (
        LEAST_OUTSTANDING,
        APPROXIMATE,
        KV_EVENTS,
    )
}
POLICY_NAMES = tuple(VOCABULARY)


def is_kv_aware(policy: str) -> bool:
    """True when `policy` routes by the prompt prefixes the engines hold cached."""
    return VOCABULARY[policy].kv_aware


def reads_kv_events(policy: str) -> bool:
    """True when `policy` reads the KV cache events of the engines it routes to."""
    return VOCABULARY[policy].kv_events
