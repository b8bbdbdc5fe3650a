"""`least-outstanding`: the balancer's own decision, unchanged (fewest requests in flight, P/D
by prompt length: docs/proxy.md "Routing"). In a proxy.json that mixes policies its engines are
scored with nothing cached (in-flight tokens only)."""

from __future__ import annotations

from collections.abc import Sequence

from hgxserve.base.routing import LEAST_OUTSTANDING
from hgxserve.proxy.kvindex import ApproxIndex, BlockIndex
from hgxserve.proxy.policies.base import Plan, Policy


class LeastOutstanding(Policy):
    vocab = LEAST_OUTSTANDING
    balancer_decides = True

    def cached(self, plan: Plan, blocks: Sequence[BlockIndex], text: ApproxIndex | None) -> int:
        return 0
