"""The simulated engine's prefix cache and its KV events (vLLM's / SGLang's ZMQ wire format).

The events are read back as a proxy reads the real engines': a SUB socket on the publisher, the
replay ROUTER asked with a start sequence number, payloads decoded with msgpack.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jinja2
import msgpack
import pytest
import zmq
from harness import SimEngine, free_port, http, http_json, metric, port_open
from tokenizers import Tokenizer

from testbed import demo
from testbed.simengine import prompt_of, prompt_token_ids

BLOCK = 16


def kv_flags(engine: str, port: int, replay: int) -> list[str]:
    config: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv-events",
    }
    if engine == "vllm":
        config["enable_kv_cache_events"] = True
        return ["serve", "/m", "--served-model-name", "m", "--kv-events-config", json.dumps(config)]
    return ["serve", "--model-path", "/m", "--served-model-name", "m",
            "--kv-events-config", json.dumps(config)]  # fmt: skip


class Events:
    """A subscriber on one publisher plus its replay endpoint."""

    def __init__(self, port: int, replay: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_addr = f"tcp://127.0.0.1:{replay}"
        time.sleep(0.3)  # PUB/SUB: the subscription must reach the publisher first

    def next(self, timeout: float = 5.0) -> tuple[int, list[Any]]:
        """The next batch, past the start's AllBlocksCleared (seq 0) when the subscription was
        in place early enough to get it."""
        while True:
            assert self.sub.poll(int(timeout * 1000)), "no KV event batch"
            topic, raw_seq, payload = self.sub.recv_multipart()
            assert topic == b"kv-events"
            seq, batch = int.from_bytes(raw_seq, "big"), msgpack.unpackb(payload)
            if seq != 0:
                return seq, batch
            assert batch[1] == [["AllBlocksCleared"]]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_addr)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            out.append((int.from_bytes(seq, "big", signed=True), payload))
            if out[-1][0] == -1:
                dealer.close(linger=0)
                return out

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def demo_tokenizer(tmp_path: Path) -> tuple[Tokenizer, jinja2.Template]:
    model = demo.make_tiny_model(tmp_path / "tiny", shards=1, shard_mib=1)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(config["chat_template"])
    return Tokenizer.from_file(str(model / "tokenizer.json")), template


CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Tu es un assistant concis. Réponds en français, s.v.p."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Grüße"}, {"type": "text", "text": "中文 ✓"}],
        },
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Encore une fois, s'il te plaît — merci."},
    ],
    "max_tokens": 4,
}
COMPLETION = {"model": "m", "prompt": "Ünïcödé prompt, 日本語 too: " + "abc " * 30, "max_tokens": 4}


def test_sim_token_ids_are_the_demo_tokenizer_s(tmp_path: Path) -> None:
    tokenizer, template = demo_tokenizer(tmp_path)
    for body in (CHAT, {**CHAT, "add_generation_prompt": False}):
        rendered = template.render(
            messages=body["messages"], add_generation_prompt=body.get("add_generation_prompt", True)
        )
        ids = prompt_token_ids(body, prompt_of(body, True), True)
        assert ids == tokenizer.encode(rendered).ids and max(ids) > 127
    ids = prompt_token_ids(COMPLETION, prompt_of(COMPLETION, False), False)
    assert ids == tokenizer.encode(COMPLETION["prompt"]).ids
    assert tokenizer.decode(ids) == COMPLETION["prompt"]
    assert prompt_token_ids({"prompt": [5, 300, 7]}, "", False) == [5, 300, 7]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_events_carry_the_stored_blocks_and_replay(tmp_path: Path, engine: str) -> None:
    tokenizer, template = demo_tokenizer(tmp_path)
    port, replay = free_port(), free_port()
    with SimEngine(engine, kv_flags(engine, port, replay), tmp_path) as eng:
        events = Events(port, replay)
        try:
            status, _ = http_json("POST", eng.url + "/v1/chat/completions", CHAT)
            assert status == 200
            seq, batch = events.next()
            rendered = template.render(messages=CHAT["messages"], add_generation_prompt=True)
            expected = tokenizer.encode(rendered).ids
            full = len(expected) // BLOCK
            assert seq == 1  # seq 0 was AllBlocksCleared at start
            if engine == "vllm":
                ts, evs, rank = batch
                assert rank == 0
            else:
                ts, evs = batch
            assert abs(ts - time.time()) < 10
            [stored] = evs
            assert stored[0] == "BlockStored" and stored[4] == BLOCK and stored[5] is None
            assert stored[6:] == (["GPU", None] if engine == "vllm" else [])
            hashes, parent, token_ids = stored[1], stored[2], stored[3]
            assert parent is None and len(hashes) == full
            assert token_ids == expected[: full * BLOCK]
            # what the sim says it holds is what it published, chained by parent hash
            ranks = http_json("GET", eng.url + "/sim/kv")[1]["ranks"]
            blocks = {b["hash"]: b for b in ranks[0]["blocks"]}
            assert set(blocks) == set(hashes)
            for i, own in enumerate(hashes):
                assert blocks[own]["parent"] == (hashes[i - 1] if i else None)
                assert blocks[own]["token_ids"] == token_ids[i * BLOCK : (i + 1) * BLOCK]
            # the next turn of the conversation stores only its new blocks, chained to the
            # last block it shares with the first turn
            turn2 = [*CHAT["messages"], {"role": "assistant", "content": "Oui."},
                     {"role": "user", "content": "Et maintenant ? " * 3}]  # fmt: skip
            assert turn2[: len(CHAT["messages"])] == CHAT["messages"]
            ids2 = tokenizer.encode(template.render(messages=turn2, add_generation_prompt=True)).ids
            assert ids2[: len(expected)] == expected  # turn 1's prompt prefixes turn 2's
            chat2 = {**CHAT, "messages": turn2}
            assert http_json("POST", eng.url + "/v1/chat/completions", chat2)[0] == 200
            _, batch = events.next()
            [stored2] = batch[1]
            assert stored2[2] == hashes[-1]
            assert stored2[3] == ids2[full * BLOCK : len(ids2) // BLOCK * BLOCK]
            # replay: every buffered batch from the asked seq on, then the end marker
            replayed = events.replay(0)
            assert [s for s, _ in replayed] == [0, 1, 2, -1] and replayed[-1][1] == b""
            assert msgpack.unpackb(replayed[0][1])[1] == [["AllBlocksCleared"]]
            assert msgpack.unpackb(replayed[1][1])[1] == [stored]
            assert [s for s, _ in events.replay(2)] == [2, -1]
            # a reset publishes AllBlocksCleared
            reset = "/reset_prefix_cache" if engine == "vllm" else "/flush_cache"
            assert http("POST", eng.url + reset)[0] == 200
            assert events.next()[1][1] == [["AllBlocksCleared"]]
            assert http_json("GET", eng.url + "/sim/kv")[1]["ranks"][0]["blocks"] == []
        finally:
            events.close()


def test_eviction_publishes_block_removed(tmp_path: Path) -> None:
    port, replay = free_port(), free_port()
    env = {"HGXSERVE_SIM_KV_TOKENS": str(5 * BLOCK)}  # room for 5 blocks
    with SimEngine("vllm", kv_flags("vllm", port, replay), tmp_path, env=env) as eng:
        events = Events(port, replay)
        try:
            first = {"model": "m", "prompt": "A" * (3 * BLOCK), "max_tokens": 2}
            second = {"model": "m", "prompt": "B" * (3 * BLOCK), "max_tokens": 2}
            assert http_json("POST", eng.url + "/v1/completions", first)[0] == 200
            a_hashes = events.next()[1][1][0][1]
            assert len(a_hashes) == 3
            assert http_json("POST", eng.url + "/v1/completions", second)[0] == 200
            evs = events.next()[1][1]
            removed = [e for e in evs if e[0] == "BlockRemoved"]
            stored = [e for e in evs if e[0] == "BlockStored"]
            # LRU evicts the tail of A's chain first (its parent block stays usable)
            assert [h for e in removed for h in e[1]] == [a_hashes[2]]
            assert all(e[2] == "GPU" for e in removed)
            assert sum(len(e[1]) for e in stored) == 3
            held = http_json("GET", eng.url + "/sim/kv")[1]["ranks"][0]["blocks"]
            assert len(held) == 5 and a_hashes[2] not in {b["hash"] for b in held}
        finally:
            events.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_cached_prefix_prefills_faster_and_counts_hits(tmp_path: Path, engine: str) -> None:
    env = {"HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": "2.0"}
    args = ["serve", "/m", "--served-model-name", "m"]
    if engine == "sglang":
        args = ["serve", "--model-path", "/m", "--served-model-name", "m"]
    with SimEngine(engine, args, tmp_path, env=env) as eng:
        body = {"model": "m", "prompt": "shared system prompt. " * 200, "max_tokens": 1}
        took = []
        for _ in range(2):
            t0 = time.monotonic()
            assert http_json("POST", eng.url + "/v1/completions", body)[0] == 200
            took.append(time.monotonic() - t0)
        assert took[0] > 1.5 and took[1] < 0.5, took  # ~1100 reported tokens at 2 s per 1000
        reqs = eng.requests()
        assert reqs[0]["cached_tokens"] == 0
        assert reqs[1]["cached_tokens"] > 0.95 * reqs[1]["prompt_tokens"]
        text = eng.metrics()
        if engine == "vllm":
            queries = metric(text, "vllm:prefix_cache_queries_total")
            hits = metric(text, "vllm:prefix_cache_hits_total")
            assert queries == 2 * reqs[0]["prompt_tokens"] and hits == reqs[1]["cached_tokens"]
            by_source = "vllm:prompt_tokens_by_source_total"
            assert metric(text, by_source, source="local_cache_hit") == hits
        else:
            assert 0.45 < metric(text, "sglang:cache_hit_rate") < 0.5


def test_prefix_caching_off_and_no_zmq_without_the_flag(tmp_path: Path) -> None:
    args = ["serve", "/m", "--served-model-name", "m"]
    with SimEngine("vllm", [*args, "--no-enable-prefix-caching"], tmp_path) as eng:
        body = {"model": "m", "prompt": "p" * 200, "max_tokens": 1}
        for _ in range(2):
            assert http_json("POST", eng.url + "/v1/completions", body)[0] == 200
        assert [r["cached_tokens"] for r in eng.requests()] == [0, 0]
        assert metric(eng.metrics(), "vllm:prefix_cache_hits_total") == 0
    with SimEngine("vllm", args, tmp_path) as eng:
        maps = Path(f"/proc/{eng.pid}/maps").read_text()
        assert "zmq" not in maps and "msgpack" not in maps  # stdlib only without the flag


def free_pair() -> int:
    """A port p with p + 1 free too (DP rank 1 publishes on p + 1), below Linux's ephemeral
    range so that no outgoing connection takes p + 1 before the engine binds it."""
    import random
    import socket

    while True:
        base = random.randrange(20000, 32000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("0.0.0.0", base))
                b.bind(("0.0.0.0", base + 1))
            except OSError:
                continue
        return base


def test_dp_ranks_publish_on_offset_ports(tmp_path: Path) -> None:
    port, replay = free_pair(), free_pair()
    args = [*kv_flags("vllm", port, replay), "--data-parallel-size", "2"]
    with SimEngine("vllm", args, tmp_path) as eng:
        rank1 = Events(port + 1, replay + 1)
        try:
            body = {"model": "m", "prompt": "r" * (2 * BLOCK + 3), "max_tokens": 2}
            status, _ = http_json(
                "POST", eng.url + "/v1/completions", body, headers={"X-data-parallel-rank": "1"}
            )
            assert status == 200
            _, batch = rank1.next()
            assert batch[2] == 1 and len(batch[1][0][1]) == 2
            assert [s for s, _ in rank1.replay(0)] == [0, 1, -1]
        finally:
            rank1.close()
        ranks = http_json("GET", eng.url + "/sim/kv")[1]["ranks"]
        assert [len(r["blocks"]) for r in ranks] == [0, 2]


def test_map_layout_as_vllm_0_26_sends_it(tmp_path: Path) -> None:
    port, replay = free_port(), free_port()
    env = {"HGXSERVE_SIM_KV_EVENTS_LAYOUT": "map", "HGXSERVE_SIM_KV_TOKENS": str(2 * BLOCK)}
    with SimEngine("vllm", kv_flags("vllm", port, replay), tmp_path, env=env) as eng:
        events = Events(port, replay)
        try:
            first = {"model": "m", "prompt": "M" * (2 * BLOCK), "max_tokens": 2}
            assert http_json("POST", eng.url + "/v1/completions", first)[0] == 200
            ts, [stored], rank = events.next()[1]
            assert rank == 0 and stored["type"] == "BlockStored"
            assert stored["token_ids"] == [ord("M")] * (2 * BLOCK) and stored["block_size"] == BLOCK
            assert stored["parent_block_hash"] is None and len(stored["block_hashes"]) == 2
            assert stored["medium"] == "GPU" and stored["group_idx"] == 0
            second = {"model": "m", "prompt": "N" * (2 * BLOCK), "max_tokens": 2}
            assert http_json("POST", eng.url + "/v1/completions", second)[0] == 200
            evs = events.next()[1][1]
            assert [e["type"] for e in evs] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
            assert [h for e in evs[:2] for h in e["block_hashes"]] == stored["block_hashes"][::-1]
            assert msgpack.unpackb(events.replay(0)[0][1])[1] == [{"type": "AllBlocksCleared"}]
        finally:
            events.close()


def test_a_venv_without_pyzmq_finds_the_system_s(tmp_path: Path) -> None:
    """A test host's runtime venv has no system site-packages: the engine then takes pyzmq and
    msgpack from Debian's dist-packages (here: the directory HGXSERVE_SIM_DIST_PACKAGES names)."""
    import subprocess
    import sys

    from harness import SIMENGINE

    port, pub, replay = free_port(), free_port(), free_port()
    argv = [sys.executable, "-S", str(SIMENGINE), "--engine", "vllm",
            *kv_flags("vllm", pub, replay), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    base = {"HGXSERVE_SIM_START_SECONDS": "0.1", "HGXSERVE_SIM_GPU_DIR": str(tmp_path / "gpus"),
            "PATH": "/usr/bin:/bin"}  # fmt: skip
    missing = subprocess.run(argv, env={**base, "HGXSERVE_SIM_DIST_PACKAGES": str(tmp_path)},
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert missing.returncode == 1 and "No module named" in missing.stdout, missing.stdout
    site = str(Path(zmq.__file__).parents[1])
    log = (tmp_path / "sim.log").open("wb")
    proc = subprocess.Popen(argv, env={**base, "HGXSERVE_SIM_DIST_PACKAGES": site},
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        events = Events(pub, replay)
        deadline = time.monotonic() + 15
        while not port_open("127.0.0.1", port):
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "sim.log"
            ).read_text()
            time.sleep(0.1)
        assert [s for s, _ in events.replay(0)] == [0, -1]  # AllBlocksCleared published
        events.close()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
