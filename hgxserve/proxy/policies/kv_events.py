"""`kv-events`: the blocks each engine reports holding in its KV events (one index per
publisher, a DP rank), matched against the request's own token ids: the longest prefix any of
its ranks holds. A request without token ids (no usable tokenizer, or one that failed on it) is
matched as `approximate` matches it."""

from __future__ import annotations

from collections.abc import Sequence

from hgxserve.base.routing import KV_EVENTS
from hgxserve.proxy.kvindex import ApproxIndex, BlockIndex
from hgxserve.proxy.policies.approximate import Approximate
from hgxserve.proxy.policies.base import Plan


class KvEvents(Approximate):
    vocab = KV_EVENTS

    def cached(self, plan: Plan, blocks: Sequence[BlockIndex], text: ApproxIndex | None) -> int:
        if plan.ids is None:
            return super().cached(plan, blocks, text)
        best = 0
        for idx in blocks:
            if idx.block_size and len(idx):
                best = max(best, idx.prefix_blocks(plan.chain(idx.block_size)) * idx.block_size)
        return best
