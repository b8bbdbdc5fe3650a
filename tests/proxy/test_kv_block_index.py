"""The per-engine block index: the proxy's own chain hash over token ids, BlockStored /
BlockRemoved / AllBlocksCleared, bounds, engines leaving rotation; the approximate index."""

from __future__ import annotations

from pathlib import Path

from kvwire import batch, blocks, cleared, removed, store_prompt, stored, write_tokenizer

from hgxserve.proxy.balancer import Pool
from hgxserve.proxy.config import parse_proxy_config
from hgxserve.proxy.kvevents import decode_batch
from hgxserve.proxy.kvindex import APPROX_CHUNK_CHARS, ApproxIndex, BlockIndex, Chain, text_chain
from hgxserve.proxy.kvroute import Router

IDS = list(range(1000, 1064))  # 4 blocks of 16


def apply(idx: BlockIndex, payload: bytes) -> None:
    idx.apply(decode_batch(payload))


def test_engine_hash_seed_does_not_matter() -> None:
    a, b = BlockIndex(), BlockIndex()
    apply(a, store_prompt(IDS, seed=b"one"))
    apply(b, store_prompt(IDS, seed=b"two"))
    request = Chain(IDS + [1, 2, 3], 16)
    assert a.prefix_blocks(request) == b.prefix_blocks(request) == 4
    assert a.block_size == 16 and len(a) == 4
    assert a.prefix_blocks(Chain([7] + IDS, 16)) == 0  # other first token: nothing shared


def test_store_in_parts_remove_and_clear() -> None:
    idx = BlockIndex()
    hashes = blocks(IDS)
    apply(idx, batch([stored(hashes[:2], None, IDS[:32])]))
    apply(idx, batch([stored(hashes[2:], hashes[1], IDS[32:])]))
    assert idx.prefix_blocks(Chain(IDS, 16)) == 4
    apply(idx, batch([removed([hashes[1]])]))
    assert idx.prefix_blocks(Chain(IDS, 16)) == 1  # the chain breaks at the removed block
    apply(idx, batch([removed([b"unknown"]), removed([hashes[0]], medium="CPU")]))
    assert idx.prefix_blocks(Chain(IDS, 16)) == 1  # unknown / other medium: no change
    apply(idx, batch([cleared()]))
    assert len(idx) == 0 and idx.prefix_blocks(Chain(IDS, 16)) == 0


def test_orphans_bounds_and_unmatched_blocks() -> None:
    hashes = blocks(IDS)
    idx = BlockIndex(cap=3)
    apply(idx, batch([stored(hashes[2:], hashes[1], IDS[32:])]))  # parent never seen
    assert idx.orphans == 2 and len(idx) == 0
    apply(idx, store_prompt(IDS))
    assert len(idx) == 3 and idx.dropped == 1  # the cap
    other = BlockIndex()
    apply(other, batch([stored(hashes, None, IDS, lora_id=3)]))
    apply(other, batch([stored(hashes, None, IDS, medium="CPU")]))
    apply(other, batch([stored(hashes, None, IDS, extra=[None, ("mm", 1), None, None])]))
    assert other.skipped == 4 + 4 + 3
    assert other.prefix_blocks(Chain(IDS, 16)) == 1  # the block before the extra keys


def test_engine_leaving_rotation_forgets_its_cache(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    config = parse_proxy_config({
        "protocol": "vllm-nixl", "served_model_name": "m",
        "combined": [{"url": "http://127.0.0.1:1",
                      "kv_events": {"publishers": ["tcp://127.0.0.1:9"]}}],
        "routing": {"policy": "kv-events", "tokenizer_dir": str(tmp_path)},
    })  # fmt: skip
    pool = Pool(config)
    router = Router(config, pool)
    inst = pool.combined[0]
    inst.set_healthy(True)
    router.indexes[inst][0].apply(decode_batch(store_prompt(IDS)))
    plan = router.plan({"prompt": IDS + [5]}, "completions")
    assert router.cached(inst, plan) == 64
    pool.mark_down(inst, "connection refused")
    assert len(router.indexes[inst][0]) == 0 and router.stats.ejected_clears == 1
    assert router.cached(inst, router.plan({"prompt": IDS}, "completions")) == 0


def test_approximate_index_expires() -> None:
    text = "s" * 300
    chain = text_chain(text)
    assert len(chain) == 300 // APPROX_CHUNK_CHARS
    idx = ApproxIndex(ttl_s=10, cap=100)
    idx.record(chain, now=0)
    assert idx.prefix_chunks(text_chain(text + "more" * 50), now=5) == len(chain)
    assert idx.prefix_chunks(chain, now=11) == 0
    idx.record(text_chain("x" * 64 * 200), now=20)  # past the cap: expired ones go first
    assert len(idx) == 100 and idx.dropped == 100
