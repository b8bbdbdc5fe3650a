"""The KV event subscriber against a real ZMQ publisher (PUB + replay ROUTER, as vLLM's) on
127.0.0.1: replay on connect, a missed seq replayed, engine restart, garbage counted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
from kvwire import Publisher, batch, cleared, store_prompt

from hgxserve.proxy.kvevents import Subscriber
from hgxserve.proxy.kvindex import BlockIndex, Chain

pytestmark = pytest.mark.timeout(60)

A = list(range(100, 164))
B = list(range(200, 232))


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def held(idx: BlockIndex, ids: list[int]) -> int:
    return idx.prefix_blocks(Chain(ids, 16))


def test_replay_on_connect_gap_and_garbage() -> None:
    async def scenario() -> None:
        pub = Publisher()
        idx = BlockIndex()
        sub = Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events", idx)
        # published before the proxy subscribed: only a replay can bring it
        pub.publish(store_prompt(A))
        task = asyncio.create_task(sub.run())
        try:
            await until(lambda: held(idx, A) == 4)
            assert sub.stats.connects == 1 and pub.replays[0] == 0
            await until(lambda: sub.stats.last_seq == 0)
            # garbage on the stream: counted, the stream goes on
            pub.send_raw([b"kv-events", b"\x00" * 8, b"\xc1"])
            pub.send_raw([b"kv-events", b"short", b""])
            await until(lambda: sub.stats.garbage == 2)
            # a batch lost on the way (seq 1), then seq 2: the gap is replayed from seq 1
            pub.publish(batch([cleared()]), send=False)
            pub.publish(store_prompt(B))
            await until(lambda: sub.stats.last_seq == 2)
            assert sub.stats.gaps == 1 and pub.replays[-1] == 1
            assert held(idx, A) == 0 and held(idx, B) == 2  # cleared, then B, in order
            assert sub.stats.events == {"BlockStored": 2, "AllBlocksCleared": 1}
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            pub.close()

    asyncio.run(scenario())


def test_engine_restart_resets_the_index() -> None:
    async def scenario() -> None:
        pub = Publisher()
        ports = (pub.pub_port, pub.replay_port)
        idx = BlockIndex()
        sub = Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events", idx)
        task = asyncio.create_task(sub.run())
        try:
            await until(lambda: sub.stats.connects == 1)
            for _ in range(3):
                pub.publish(batch([]))
            pub.publish(store_prompt(A))
            await until(lambda: held(idx, A) == 4)
            pub.close()
            # the engine restarts on the same ports: its seq starts at 0 and its cache is empty
            pub = Publisher(pub_port=ports[0], replay_port=ports[1])
            await until(lambda: sub.stats.connects == 2)
            pub.publish(store_prompt(B))
            await until(lambda: held(idx, B) == 2)
            assert sub.stats.restarts == 1 and held(idx, A) == 0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            pub.close()

    asyncio.run(scenario())


def test_no_replay_endpoint_and_unreachable_replay() -> None:
    async def scenario() -> None:
        pub = Publisher()
        idx = BlockIndex()
        # a replay address nothing answers: the replay times out, counted; live events apply
        sub = Subscriber(pub.endpoint, "tcp://127.0.0.1:9", "kv-events", idx)
        task = asyncio.create_task(sub.run())
        try:
            await until(lambda: sub.stats.connects == 1)
            await until(lambda: sub.stats.replay_failures == 1, timeout=15)
            for _ in range(20):
                pub.publish(store_prompt(A))
                await asyncio.sleep(0.05)
                if held(idx, A) == 4:
                    break
            assert held(idx, A) == 4
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            pub.close()

    asyncio.run(scenario())
