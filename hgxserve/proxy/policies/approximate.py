"""`approximate`: the proxy's own index of the prompt text it sent each engine, in chunks of
APPROX_CHUNK_CHARS characters, forgotten approx_ttl_s after their last use; a cached prefix's
characters count as tokens at routing.bytes_per_token."""

from __future__ import annotations

from collections.abc import Sequence

from hgxserve.base.routing import APPROXIMATE
from hgxserve.proxy.kvindex import APPROX_CHUNK_CHARS, ApproxIndex, BlockIndex
from hgxserve.proxy.policies.base import Plan, Policy


class Approximate(Policy):
    vocab = APPROXIMATE
    text_index = True

    def cached(self, plan: Plan, blocks: Sequence[BlockIndex], text: ApproxIndex | None) -> int:
        if text is None or not plan.chunks:  # a request matched by token ids has no chunks
            return 0
        chars = text.prefix_chunks(plan.chunks) * APPROX_CHUNK_CHARS
        return min(plan.tokens, int(chars / self.routing.bytes_per_token))
