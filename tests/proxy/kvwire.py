"""KV event messages built with msgpack exactly as vLLM's msgspec structs encode them
(vllm/distributed/kv_events.py: array_like, tag=True, omit_defaults), and a real ZMQ publisher
(PUB + replay ROUTER) like vLLM's ZmqEventPublisher, for the proxy's KV routing tests."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def engine_hash(parent: bytes | None, tokens: list[int], seed: bytes = b"seed") -> bytes:
    """An engine-side block hash (vLLM: sha256 of parent, tokens and its hash seed)."""
    return hashlib.sha256(seed + (parent or b"") + repr(tokens).encode()).digest()


def blocks(tokens: list[int], size: int = 16, seed: bytes = b"seed") -> list[bytes]:
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // size):
        parent = engine_hash(parent, tokens[i * size : (i + 1) * size], seed)
        out.append(parent)
    return out


def stored(
    hashes: list[Any],
    parent: Any,
    token_ids: list[int],
    size: int = 16,
    *,
    lora_id: Any = None,
    medium: Any = "GPU",
    lora_name: Any = None,
    extra: list[Any] | None = None,
) -> list[Any]:
    # BlockStored: lora_id, medium and lora_name have no default (always written); the
    # fields after them default to None and are left out while None
    ev = ["BlockStored", hashes, parent, token_ids, size, lora_id, medium, lora_name]
    if extra is not None:
        ev.append(extra)
    return ev


def removed(hashes: list[Any], medium: Any = "GPU") -> list[Any]:
    return ["BlockRemoved", hashes, medium]


def cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def batch(events: list[Any], ts: float = 1.0, rank: int | None = None) -> bytes:
    raw: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    return msgpack.packb(raw, use_bin_type=True)


def store_prompt(tokens: list[int], size: int = 16, seed: bytes = b"seed") -> bytes:
    """One batch storing every whole block of `tokens` from the root."""
    hashes = blocks(tokens, size, seed)
    return batch([stored(hashes, None, tokens[: len(hashes) * size], size)])


class Publisher:
    """A vLLM-like ZMQ KV event publisher: PUB (topic, seq, payload) and a replay ROUTER
    answering (b"", seq, payload)... then (b"", -1, b"") from its buffer."""

    def __init__(self, topic: str = "kv-events", pub_port: int = 0, replay_port: int = 0) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.pub_port = self._bind(self.pub, pub_port)
        self.replay_port = self._bind(self.replay, replay_port)
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.replays: list[int] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replays, daemon=True)
        self.thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket, port: int) -> int:
        if port:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return port
        return sock.bind_to_random_port("tcp://127.0.0.1")

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, payload: bytes, send: bool = True) -> int:
        """Buffer a batch under the next seq and (unless `send` is False: a lost message)
        publish it."""
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if send:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        with self.lock:
            self.pub.send_multipart(frames)

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            client, _, start = self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            with self.lock:
                self.replays.append(first)
                for seq, payload in list(self.buffer):
                    if seq >= first:
                        self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                self.replay.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.close(0)
        self.replay.close(0)
        self.ctx.term()


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(directory: Any, template: str | None = CHAT_TEMPLATE) -> None:
    """A byte-level tokenizer.json built with `tokenizers` (token id = UTF-8 byte value) and a
    tokenizer_config.json with a chat template."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # ByteLevel's byte -> character map, in byte order (GPT-2's bytes_to_unicode)
    chars = _bytes_to_unicode()
    assert set(chars.values()) == set(alphabet)
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": {"content": "^"}, "eos_token": "$"}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))
