"""KV cache events from the engines: vLLM's (and SGLang's) ZMQ publisher wire format, and one
subscriber per publisher (one per data-parallel rank) that feeds the block index.

Wire format (vllm/distributed/kv_events.py, msgspec array_like tagged structs, trailing
defaults omitted): a PUB message is (topic, seq as 8-byte big-endian, payload); the payload is
msgpack of

    EventBatch       = [ts, [event, ...], data_parallel_rank?]
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                        lora_id?, medium?, lora_name?, extra_keys?, ...]
    BlockRemoved     = ["BlockRemoved", block_hashes, medium?, ...]
    AllBlocksCleared = ["AllBlocksCleared", ...]

vLLM 0.26 and later send each event as a map instead ({"type": "BlockStored", "block_hashes":
..., "token_ids": ..., ...}, the EventBatch still an array): both layouts are read.

Replay: a DEALER sends (b"", start seq as 8 bytes) to the publisher's ROUTER; it answers
(b"", seq, payload) for every buffered batch from that seq on, then (b"", -1 as 8 signed bytes,
b"").

    batch = decode_batch(payload)          # KVEventError on anything malformed
    sub = Subscriber("tcp://10.0.0.11:28100", "tcp://10.0.0.11:29100", "kv-events", index)
    task = asyncio.create_task(sub.run())
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("hgxserve.proxy")

# Bounds on what one message may carry. A batch is one engine step's events: vLLM stores a
# prompt's blocks in one BlockStored, so a 1M-token prompt at 16 tokens a block is 65,536
# hashes and 1M token ids (~5 MiB of msgpack); anything larger is refused as garbage.
MAX_PAYLOAD_BYTES = 16 << 20
MAX_LIST_LEN = 1 << 21
MAX_EVENTS_PER_BATCH = 1 << 16
# block hashes, token ids and extra keys of all a batch's events together: the 1M-token prompt
# twice over. 16 MiB of small integers is 16M of them, whose checks and index updates held
# the event loop for seconds per batch; a batch over this is refused (garbage) after decoding
# (~0.3 s at 16 MiB), one within it costs ~0.1 s
MAX_BATCH_ITEMS = 1 << 21
MAX_HASH_BYTES = 64
MAX_BLOCK_SIZE = 1 << 12
# replay: vLLM and SGLang keep the last 10,000 batches (buffer_steps); a replay silent for
# REPLAY_SILENCE_S (the publisher answers from memory in well under a second) is given up
MAX_REPLAY_MESSAGES = 20_000
REPLAY_SILENCE_S = 5.0
# a replay that goes on this long in all is given up too (a publisher trickling its answer
# under the silence bound held the subscriber for hours)
REPLAY_MAX_S = 60.0
# socket re-creation after an error: 0.1 s doubling to 10 s; ZMQ's own reconnect likewise
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 10.0
# live messages ZMQ queues for one publisher while the subscriber is busy (a replay, a
# batch); past it ZMQ drops them, which is a gap: replayed, or the index starts over
RCVHWM = 1_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Hash = int | bytes


class KVEventError(ValueError):
    """A KV event message that does not follow the wire format."""


@dataclass
class Stored:
    block_hashes: list[Hash]
    parent: Hash | None
    token_ids: list[int]
    block_size: int
    # LoRA adapter, medium and per-block extra keys: blocks with any of them are not plain
    # prompt-token blocks and are not matched (kvindex)
    lora: Any = None
    medium: str | None = None
    extra_keys: list[Any] | None = None


@dataclass
class Removed:
    block_hashes: list[Hash]
    medium: str | None = None


@dataclass
class Cleared:
    medium: str | None = None


Event = Stored | Removed | Cleared
# each event's name on the wire (and in /metrics)
TAGS: dict[type, str] = {
    Stored: "BlockStored",
    Removed: "BlockRemoved",
    Cleared: "AllBlocksCleared",
}


@dataclass
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None


_HASH_TYPES = {int, bytes}


def _hashes(value: Any) -> list[Hash]:
    if not isinstance(value, list):
        raise KVEventError("block_hashes is not a list")
    # (types collected in C: a Python loop over 2M hashes took a second; bytes are at most
    # MAX_HASH_BYTES long already, msgpack's max_bin_len)
    if not set(map(type, value)) <= _HASH_TYPES:
        raise KVEventError("a block hash is neither an integer nor bytes")
    return value


def _medium(fields: list[Any], i: int) -> str | None:
    value = fields[i] if len(fields) > i else None
    if value is not None and not isinstance(value, str):
        raise KVEventError("medium is not a string")
    return value


def _stored(f: list[Any]) -> Stored:
    if len(f) < 5:
        raise KVEventError("BlockStored has fewer than 4 fields")
    hashes = _hashes(f[1])
    parent = f[2]
    if parent is not None:
        parent = _hashes([parent])[0]
    ids, size = f[3], f[4]
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_BLOCK_SIZE:
        raise KVEventError(f"block_size {size!r} is out of range")
    if not isinstance(ids, list) or (ids and set(map(type, ids)) != {int}):
        raise KVEventError("token_ids is not a list of integers")
    if len(ids) != size * len(hashes):
        raise KVEventError("token_ids does not hold block_size tokens per block")
    lora = f[5] if len(f) > 5 else None
    if len(f) > 7 and f[7] is not None:
        lora = lora or f[7]  # lora_name
    extra = f[8] if len(f) > 8 else None
    if extra is not None and not isinstance(extra, list):
        raise KVEventError("extra_keys is not a list")
    return Stored(hashes, parent, ids, size, lora, _medium(f, 6), extra)


# The named layout: vLLM structs without array_like (vLLM 0.26 on) arrive as maps tagged by
# "type"; their fields in the array layout's order, so one decoder reads both.
MAP_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": ("medium",),
}


def _from_map(raw: dict[Any, Any]) -> list[Any]:
    """A map-layout event as the array layout: [tag, field, ...] (absent fields None)."""
    tag = raw.get("type")
    if not isinstance(tag, str) or tag not in MAP_FIELDS:
        raise KVEventError(f"unknown event {str(tag)[:40]!r}")
    names = MAP_FIELDS[tag]
    if tag != "AllBlocksCleared" and "block_hashes" not in raw:
        raise KVEventError(f"{tag} has no block_hashes")
    return [tag, *(raw.get(name) for name in names)]


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        raw = _from_map(raw)
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise KVEventError("an event is not a tagged array")
    tag = raw[0]
    if tag == "BlockStored":
        return _stored(raw)
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise KVEventError("BlockRemoved has no block_hashes")
        return Removed(_hashes(raw[1]), _medium(raw, 2))
    if tag == "AllBlocksCleared":
        return Cleared(_medium(raw, 1))
    raise KVEventError(f"unknown event {tag[:40]!r}")


def decode_batch(payload: bytes) -> Batch:
    """One EventBatch from its msgpack payload; KVEventError when it is not one.

    Example: decode_batch(msgpack.packb([1.5, [["AllBlocksCleared"]]])).events == [Cleared()]
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVEventError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=1 << 16,
            max_bin_len=MAX_HASH_BYTES,
            max_array_len=MAX_LIST_LEN,
            max_map_len=1 << 10,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KVEventError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):  # the batch as a map too (vLLM's newest layout)
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventError("not an EventBatch [ts, events, ...]")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventError("ts is not a number")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise KVEventError(f"more than {MAX_EVENTS_PER_BATCH} events in one batch")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventError("data_parallel_rank is not an integer")
    items = 0
    for e in events:  # counted before anything is checked element by element
        fields = e.values() if isinstance(e, dict) else e if isinstance(e, list) else ()
        items += sum(len(f) for f in fields if isinstance(f, list))
    if items > MAX_BATCH_ITEMS:
        raise KVEventError(f"more than {MAX_BATCH_ITEMS} hashes and token ids in one batch")
    return Batch(float(ts), [_event(e) for e in events], rank)


def seq_of(frame: bytes) -> int:
    """The sequence number frame: 8 bytes, big-endian."""
    if len(frame) != 8:
        raise KVEventError("the sequence frame is not 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


@dataclass
class SubscriberStats:
    """What one publisher's subscriber has seen (rendered in /metrics by kvroute)."""

    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    replayed: int = 0
    replays: int = 0
    replay_failures: int = 0
    garbage: int = 0
    gaps: int = 0
    restarts: int = 0
    connects: int = 0
    last_seq: int = -1
    last_event_time: float = 0.0


class Sink(Protocol):
    """What the subscriber feeds: `apply` each batch in seq order, `clear` when the engine's
    cache is no longer known (it restarted, or what was missed cannot be replayed)."""

    def apply(self, batch: Batch) -> None: ...

    def clear(self) -> None: ...


class Subscriber:
    """One publisher (one DP rank of one engine): SUB for live batches, DEALER for replays.

    Applies batches in seq order: a gap (a seq past the next expected one) and every
    (re)connect replay from the next expected seq; a seq below the last live one means the
    engine restarted (its cache is empty): the sink is cleared and everything the publisher still
    buffers is replayed. Garbage is counted and skipped, never raised.

    The event loop is never held for more than one batch: the subscriber yields to it after
    each message, live or replayed. A gap is filled as soon as it is seen: the batches behind
    it stay in ZMQ's queue as received (RCVHWM of them at most; past it ZMQ drops them, a
    further gap), not decoded in the proxy's memory while the replay runs (decoded, ~10 times
    their wire size, they grew the proxy by 357 MiB in one gap).
    """

    def __init__(self, endpoint: str, replay: str | None, topic: str, sink: Sink) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.topic = topic.encode()
        self.sink = sink
        self.stats = SubscriberStats()
        self.live_last = -1  # the last seq seen on the live stream
        self.pending: list[tuple[int, Batch]] = []  # the live batch past a gap, until replayed
        self.ctx = zmq.asyncio.Context.instance()

    async def run(self) -> None:
        """Subscribe until cancelled; socket errors re-create the sockets with backoff."""
        delay = RECONNECT_MIN_S
        while True:
            started = time.monotonic()
            try:
                await self._session()
            except Exception as exc:  # a socket error, or a fault in the index: start over
                log.warning("KV events %s: %r; reconnecting in %.1f s", self.endpoint, exc, delay)
            if time.monotonic() - started > RECONNECT_MAX_S:
                delay = RECONNECT_MIN_S
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    def _socket(self) -> zmq.asyncio.Socket:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sub.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_MIN_S * 1000))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        return sub

    async def _session(self) -> None:
        sub = self._socket()
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._connected(monitor)
                if sub in ready:
                    self._live(await sub.recv_multipart())
                    # drain what queued without another poll round trip, one batch at a time
                    # (others run between them), until a gap is to be filled
                    while not self.pending and await sub.poll(0):
                        await asyncio.sleep(0)
                        self._live(await sub.recv_multipart())
                if self.pending:
                    await self._fill_gap()
                await asyncio.sleep(0)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _connected(self, monitor: zmq.asyncio.Socket) -> None:
        frames = await monitor.recv_multipart()
        with contextlib.suppress(ValueError, KeyError):
            if parse_monitor_message(frames)["event"] != zmq.EVENT_CONNECTED:
                return
        self.stats.connects += 1
        # what was published while no connection was up (or, first time, still buffered)
        await self.replay(self.stats.last_seq + 1)

    def _live(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise KVEventError(f"{len(frames)} frames, not 3")
            seq = seq_of(frames[1])
            batch = decode_batch(frames[2])
        except KVEventError as exc:
            self._garbage(exc)
            return
        if seq < self.live_last:
            self._restarted(seq)
        self.live_last = seq
        if self.pending or seq > self.stats.last_seq + 1:
            # a gap: held until the replay of what is missing (in order, then this)
            self.pending.append((seq, batch))
            return
        self._apply(seq, batch)

    async def _fill_gap(self) -> None:
        self.stats.gaps += 1
        if not await self.replay(self.stats.last_seq + 1):
            # what was missed is unknown: start over from what comes
            self.sink.clear()
        pending, self.pending = self.pending, []
        for seq, batch in pending:
            self._apply(seq, batch)

    def _restarted(self, seq: int) -> None:
        log.info("KV events %s: seq went back to %d: engine restarted", self.endpoint, seq)
        self.stats.restarts += 1
        self.stats.last_seq = -1
        self.pending = []
        self.sink.clear()

    def _apply(self, seq: int, batch: Batch) -> None:
        if seq <= self.stats.last_seq:
            return  # seen already (a replay overlapping the live stream)
        self.stats.last_seq = seq
        self.stats.batches += 1
        self.stats.last_event_time = time.time()
        for ev in batch.events:
            name = TAGS[type(ev)]
            self.stats.events[name] = self.stats.events.get(name, 0) + 1
        self.sink.apply(batch)

    def _garbage(self, exc: Exception) -> None:
        self.stats.garbage += 1
        if self.stats.garbage in (1, 10, 100) or self.stats.garbage % 1000 == 0:
            log.warning("KV events %s: garbage #%d: %s", self.endpoint, self.stats.garbage, exc)

    async def replay(self, start: int) -> bool:
        """Ask the replay endpoint for every batch from `start` on, applying each in order as
        it comes; False when there is no endpoint or the replay failed (silent for
        REPLAY_SILENCE_S, broken, or longer than MAX_REPLAY_MESSAGES)."""
        if not self.replay_endpoint:
            return False
        self.stats.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", max(start, 0).to_bytes(8, "big")])
            await self._replayed(dealer, start)
            return True
        except (asyncio.TimeoutError, zmq.ZMQError, KVEventError) as exc:
            self.stats.replay_failures += 1
            log.warning("KV events %s: replay from %d failed: %r", self.endpoint, start, exc)
            return False
        finally:
            dealer.close(0)

    async def _replayed(self, dealer: zmq.asyncio.Socket, start: int) -> None:
        first = True
        until = time.monotonic() + REPLAY_MAX_S
        for _ in range(MAX_REPLAY_MESSAGES):
            left = until - time.monotonic()
            if left <= 0:
                raise KVEventError(f"a replay of more than {REPLAY_MAX_S:g} s")
            frames = await asyncio.wait_for(dealer.recv_multipart(), min(REPLAY_SILENCE_S, left))
            if len(frames) != 3:
                raise KVEventError(f"a replay message of {len(frames)} frames")
            if frames[1] == END_SEQ:
                return
            try:
                seq, batch = seq_of(frames[1]), decode_batch(frames[2])
            except KVEventError as exc:
                self._garbage(exc)
                continue
            if first and 0 < start < seq:
                # the publisher no longer holds what was missed: start over from what it holds
                log.info("KV events %s: replay starts at %d, not %d: index resynchronised",
                         self.endpoint, seq, start)  # fmt: skip
                self.stats.replay_failures += 1
                self.sink.clear()
            first = False
            self.stats.replayed += 1
            self._apply(seq, batch)
            await asyncio.sleep(0)  # one batch at a time: others run between them
        raise KVEventError(f"a replay of more than {MAX_REPLAY_MESSAGES} messages")
