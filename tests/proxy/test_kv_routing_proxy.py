"""`hgxserve proxy serve` with policy kv-events against simulated engines on 127.0.0.1, each
with a real ZMQ KV event publisher: the request goes where its prompt is cached, the decision
and the index are in /metrics, and an engine leaving rotation is forgotten."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import SimEngine, http_json, metric
from kvwire import Publisher, store_prompt, wait_for, write_tokenizer

from hgxserve.proxy.tokens import PromptTokenizer

pytestmark = pytest.mark.timeout(90)

SYSTEM = "You are a careful assistant. Follow the house style guide. " * 40  # ~2,400 tokens


@pytest.fixture
def publishers() -> Iterator[Callable[[], Publisher]]:
    made: list[Publisher] = []

    def make() -> Publisher:
        made.append(Publisher())
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def body(question: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip


def test_request_follows_the_cached_prefix(
    tmp_path: Path,
    engines: Callable[..., SimEngine],
    proxy: Callable[..., Any],
    publishers: Callable[[], Publisher],
) -> None:
    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir)
    sims = [engines("vllm", ["serve", "/models/m", "--served-model-name", "m"]) for _ in range(3)]
    pubs = [publishers() for _ in sims]
    combined = [
        {"url": s.url, "kv_events": {"publishers": [p.endpoint], "replays": [p.replay_endpoint]}}
        for s, p in zip(sims, pubs, strict=True)
    ]
    px = proxy({
        "protocol": "vllm-nixl", "served_model_name": "m", "combined": combined,
        "routing": {"policy": "kv-events", "tokenizer_dir": str(tok_dir)},
    })  # fmt: skip
    px.wait_in_rotation()
    # engine 1 caches the system prompt (the blocks of its rendered, tokenized chat)
    ids = PromptTokenizer.load(str(tok_dir)).prompt_ids(body("first"), "chat")
    pubs[1].publish(store_prompt(ids[: len(ids) - 40]))
    hot = {"role": "combined", "instance": sims[1].url}
    wait_for(lambda: metric(px.metrics(), "hgxserve_proxy_kv_index_blocks", **hot) > 100)
    for question in ("second", "third", "fourth"):
        status, _ = http_json("POST", px.url + "/v1/chat/completions", body(question))
        assert status == 200
    assert [len(s.requests()) for s in sims] == [0, 3, 0]
    text = px.metrics()
    assert metric(text, "hgxserve_proxy_route_decisions_total",
                  route="combined", reason="cache-hit") == 3  # fmt: skip
    assert metric(text, "hgxserve_proxy_prompt_match_total", path="tokens") == 3
    assert metric(text, "hgxserve_proxy_kv_events_total", type="BlockStored", **hot) == 1
    assert metric(text, "hgxserve_proxy_cached_prompt_tokens_count") == 3
    assert metric(text, "hgxserve_proxy_inflight_tokens", **hot) == 0  # all finished
    # the engine leaves rotation: its entries go, and requests spread again
    sims[1].kill()
    wait_for(lambda: metric(px.metrics(), "hgxserve_proxy_instance_healthy", **hot) == 0)
    text = px.metrics()
    assert metric(text, "hgxserve_proxy_kv_index_blocks", **hot) == 0
    assert metric(text, "hgxserve_proxy_kv_index_ejection_clears_total") == 1
    status, _ = http_json("POST", px.url + "/v1/chat/completions", body("fifth"))
    assert status == 200
    assert metric(px.metrics(), "hgxserve_proxy_route_decisions_total",
                  route="combined", reason="no-cache") == 1  # fmt: skip
