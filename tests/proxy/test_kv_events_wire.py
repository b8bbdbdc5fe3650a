"""The KV event wire format (vLLM's msgspec EventBatch in msgpack): decoded exactly, garbage
refused with KVEventError, every read bounded."""

from __future__ import annotations

import msgpack
import pytest
from kvwire import batch, blocks, cleared, removed, stored

from hgxserve.proxy.kvevents import (
    MAX_EVENTS_PER_BATCH,
    MAX_PAYLOAD_BYTES,
    Cleared,
    KVEventError,
    Removed,
    Stored,
    decode_batch,
    seq_of,
)


def test_vllm_batch_decodes_field_by_field() -> None:
    tokens = list(range(32))
    hashes = blocks(tokens)
    payload = batch(
        [stored(hashes, None, tokens), removed([hashes[1]]), cleared()], ts=12.5, rank=3
    )
    got = decode_batch(payload)
    assert got.ts == 12.5 and got.dp_rank == 3
    assert got.events == [
        Stored(hashes, None, tokens, 16, None, "GPU", None),
        Removed([hashes[1]], "GPU"),
        Cleared(),
    ]


def test_old_and_new_layouts() -> None:
    # vLLM 0.9: int hashes, BlockStored ends at lora_id, BlockRemoved has no medium
    old = msgpack.packb([1.0, [["BlockStored", [7, 8], 6, list(range(8)), 4, None],
                               ["BlockRemoved", [7]]]])  # fmt: skip
    ev = decode_batch(old).events
    assert ev[0] == Stored([7, 8], 6, list(range(8)), 4, None, None, None)
    assert ev[1] == Removed([7], None)
    # newer: extra_keys, group_idx and spec fields appended, ignored past extra_keys
    new = batch([stored([b"h"], b"p", [1, 2], 2, extra=[None]) + [0, "full", None, "LOCAL"]])
    st = decode_batch(new).events[0]
    assert isinstance(st, Stored) and st.extra_keys == [None] and st.parent == b"p"
    # lora_name (field 7) marks a LoRA block like lora_id does
    lora = decode_batch(batch([stored([1], None, [1, 2], 2, lora_name="adapter")])).events[0]
    assert isinstance(lora, Stored) and lora.lora == "adapter"


def test_map_layout_of_newer_vllm() -> None:
    # vLLM 0.26 on: events are maps tagged by "type" (field names, extra fields such as
    # group_idx ignored); the EventBatch around them is still an array
    tokens = list(range(32))
    hashes = blocks(tokens)
    payload = msgpack.packb(
        [
            2.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": tokens,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    got = decode_batch(payload)
    assert got.events == [
        Stored(hashes, None, tokens, 16, None, "GPU", [None, None]),
        Removed([hashes[1]], "GPU"),
        Cleared(),
    ]
    # the batch itself as a map (vLLM's newest source)
    as_map = msgpack.packb({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}],
                            "data_parallel_rank": 1})  # fmt: skip
    got = decode_batch(as_map)
    assert (got.ts, got.events, got.dp_rank) == (3.0, [Cleared()], 1)
    for bad in ({"type": "Nope"}, {"block_hashes": [1]}, {"type": "BlockRemoved"}):
        with pytest.raises(KVEventError):
            decode_batch(msgpack.packb([1.0, [bad]]))
    # a map event is checked like an array one: token ids must fill the blocks
    short = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 2}
    with pytest.raises(KVEventError):
        decode_batch(msgpack.packb([1.0, [short]]))


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"ts": 1}),  # a map, not an array
        msgpack.packb([1.0]),  # no events
        msgpack.packb(["x", []]),  # ts not a number
        msgpack.packb([1.0, [["Nope"]]]),  # unknown tag
        msgpack.packb([1.0, [[1, 2]]]),  # untagged
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]]),  # 3 != 2 x 1
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 0, None]]]),  # block_size 0
        msgpack.packb([1.0, [["BlockStored", [1.5], None, [1, 2], 2, None]]]),  # float hash
        msgpack.packb([1.0, [["BlockStored", [1], None, ["a", "b"], 2, None]]]),  # str ids
        msgpack.packb([1.0, [["BlockStored", [b"x" * 65], None, [1, 2], 2, None]]]),  # long
        msgpack.packb([1.0, [["BlockRemoved"]]]),
        msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]),  # medium not a string
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, []]) + b"\x00",  # trailing bytes
        msgpack.packb([1.0, [[]] * (MAX_EVENTS_PER_BATCH + 1)]),
    ],
)
def test_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(KVEventError):
        decode_batch(raw)


def test_reads_are_bounded() -> None:
    with pytest.raises(KVEventError, match="over"):
        decode_batch(b"\x90" * (MAX_PAYLOAD_BYTES + 1))
    # an array header claiming 2^32-1 elements is refused before anything is allocated
    with pytest.raises(KVEventError):
        decode_batch(b"\xdd\xff\xff\xff\xff")
    with pytest.raises(KVEventError):
        seq_of(b"\x00" * 7)
    assert seq_of((5).to_bytes(8, "big")) == 5
