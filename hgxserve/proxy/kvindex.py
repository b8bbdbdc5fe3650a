"""Which prompt prefixes each engine holds in its KV cache: block indexes the proxy keeps.

BlockIndex: one engine publisher's blocks (one DP rank), built from its KV events with the
proxy's own chain hash of each block's token ids, so the engine's hash seed does not matter.
ApproxIndex: without a tokenizer, prefixes of the prompt text in fixed character chunks, as the
proxy itself routed them, forgotten after a TTL.

    idx = BlockIndex(cap=262_144)
    idx.apply(batch)                                   # kvevents.Batch
    chain = Chain(token_ids)                           # the request's own block hashes
    idx.prefix_blocks(chain)                           # leading blocks the engine holds
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hgxserve.proxy.kvevents import Batch, Cleared, Hash, Removed, Stored

# A block chain starts from this parent; hash() of a tuple of ints is the same in every
# process (PYTHONHASHSEED salts only str and bytes) and costs ~0.4 us for a 16-token block,
# a sixth of blake2b's with digest_size=8 (benchmarks/bench_kv_index.py: 766 against
# 4,597 us for a 32k-token prompt). 64 bits: a false match misroutes one request, no more.
ROOT = 0x9E3779B97F4A7C15
# Blocks remembered per publisher: an 8 x H200 engine of a 70B-class model holds ~1.5M tokens
# of KV at FP8 (~100k blocks of 16); 262,144 leaves room for smaller models (~100 bytes of
# index a block: ~25 MiB at the cap). Past it, new blocks are dropped, and counted.
MAX_BLOCKS = 262_144
# the approximate index: 64 characters a chunk (~16 tokens at 4 bytes a token: one vLLM
# block), at most this many chunks remembered per engine
APPROX_CHUNK_CHARS = 64
APPROX_MAX_CHUNKS = 262_144
# media whose blocks the proxy matches: the GPU cache (None: publishers that do not say)
MATCHED_MEDIA = (None, "GPU", "gpu")


def block_hash(parent: int, tokens: Iterable[int]) -> int:
    """The proxy's own hash of one block: its parent's and its token ids."""
    return hash((parent, *tokens))


class Chain:
    """A request's block hashes at one block size, computed only as far as a lookup needs."""

    __slots__ = ("ids", "size", "hashes")

    def __init__(self, ids: list[int], size: int) -> None:
        self.ids = ids
        self.size = size
        self.hashes: list[int] = []

    def __len__(self) -> int:
        return len(self.ids) // self.size

    def at(self, i: int) -> int:
        hashes = self.hashes
        while len(hashes) <= i:
            n = len(hashes)
            parent = hashes[-1] if hashes else ROOT
            hashes.append(hash((parent, *self.ids[n * self.size : (n + 1) * self.size])))
        return hashes[i]


class BlockIndex:
    """One publisher's cached blocks: engine hash -> own hash, own hash -> engines' count."""

    def __init__(self, cap: int = MAX_BLOCKS) -> None:
        self.cap = cap
        self.by_engine: dict[Hash, int] = {}
        self.own: dict[int, int] = {}
        self.block_size: int | None = None
        self.dropped = 0  # blocks not stored: the index was full
        self.orphans = 0  # blocks whose parent the index does not know (missed events)
        self.skipped = 0  # LoRA / multimodal / other-medium blocks (not plain prompt tokens)

    def __len__(self) -> int:
        return len(self.by_engine)

    def apply(self, batch: Batch) -> None:
        for ev in batch.events:
            if isinstance(ev, Stored):
                self.store(ev)
            elif isinstance(ev, Removed):
                if ev.medium in MATCHED_MEDIA:
                    self.remove(ev.block_hashes)
            elif isinstance(ev, Cleared) and ev.medium in MATCHED_MEDIA:
                self.clear()

    def store(self, ev: Stored) -> None:
        n = len(ev.block_hashes)
        if ev.lora or ev.medium not in MATCHED_MEDIA:
            self.skipped += n
            return
        if ev.parent is None:
            parent = ROOT
        elif ev.parent in self.by_engine:
            parent = self.by_engine[ev.parent]
        else:
            self.orphans += n
            return
        self.block_size = size = ev.block_size
        extra = ev.extra_keys or ()
        ids = ev.token_ids
        for i, engine_hash in enumerate(ev.block_hashes):
            if i < len(extra) and extra[i] is not None:
                self.skipped += n - i  # a block with extra keys: its children differ too
                return
            parent = hash((parent, *ids[i * size : (i + 1) * size]))
            if engine_hash in self.by_engine:
                continue
            if len(self.by_engine) >= self.cap:
                self.dropped += n - i
                return
            self.by_engine[engine_hash] = parent
            self.own[parent] = self.own.get(parent, 0) + 1

    def remove(self, hashes: list[Hash]) -> None:
        for engine_hash in hashes:
            own = self.by_engine.pop(engine_hash, None)
            if own is None:
                continue
            left = self.own[own] - 1
            if left:
                self.own[own] = left
            else:
                del self.own[own]

    def clear(self) -> None:
        self.by_engine.clear()
        self.own.clear()

    def prefix_blocks(self, chain: Chain) -> int:
        """How many of the chain's leading blocks this publisher holds."""
        own = self.own
        n = 0
        for i in range(len(chain)):
            if chain.at(i) not in own:
                break
            n += 1
        return n


def text_chain(text: str) -> list[int]:
    """Chain hashes of the text's whole APPROX_CHUNK_CHARS chunks."""
    out: list[int] = []
    parent = ROOT
    step = APPROX_CHUNK_CHARS
    for i in range(0, len(text) - step + 1, step):
        parent = hash((parent, text[i : i + step]))
        out.append(parent)
    return out


class ApproxIndex:
    """Prompt-text prefixes the proxy sent to one engine, each kept `ttl_s` after its last use."""

    def __init__(self, ttl_s: float, cap: int = APPROX_MAX_CHUNKS) -> None:
        self.ttl_s = ttl_s
        self.cap = cap
        self.expiry: dict[int, float] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.expiry)

    def record(self, chain: list[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if len(self.expiry) + len(chain) > self.cap:
            self.expire(now)
        until = now + self.ttl_s
        for h in chain:
            if h not in self.expiry and len(self.expiry) >= self.cap:
                self.dropped += 1
                continue
            self.expiry[h] = until

    def expire(self, now: float) -> None:
        self.expiry = {h: t for h, t in self.expiry.items() if t > now}

    def prefix_chunks(self, chain: list[int], now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        n = 0
        for h in chain:
            t = self.expiry.get(h)
            if t is None or t <= now:
                break
            n += 1
        return n

    def clear(self) -> None:
        self.expiry.clear()
