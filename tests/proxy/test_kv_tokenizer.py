"""The proxy's tokenizer: tokenizer.json through `tokenizers`, chat through the model's own
template in a sandbox; failures leave the request to the approximate index (counted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvwire import write_tokenizer

from hgxserve.proxy.balancer import Pool
from hgxserve.proxy.config import parse_proxy_config
from hgxserve.proxy.kvroute import Router, load_tokenizer
from hgxserve.proxy.tokens import PromptTokenizer, TokenizerError


@pytest.fixture
def tok(tmp_path: Path) -> PromptTokenizer:
    write_tokenizer(tmp_path)
    return PromptTokenizer.load(str(tmp_path))


def test_completion_and_token_prompts(tok: PromptTokenizer) -> None:
    assert tok.prompt_ids({"prompt": "héllo"}, "completions") == list("héllo".encode())
    assert tok.prompt_ids({"prompt": ["ab"]}, "completions") == [97, 98]
    assert tok.prompt_ids({"prompt": [5, 6, 7]}, "completions") == [5, 6, 7]
    with pytest.raises(TokenizerError):
        tok.prompt_ids({"prompt": ["a", "b"]}, "completions")  # a batch: approximate
    with pytest.raises(TokenizerError):
        tok.prompt_ids({"prompt": 5}, "completions")


def test_chat_rendered_with_the_template(tok: PromptTokenizer) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hi"}]}  # fmt: skip
    text = "^<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert tok.render_chat(body) == text
    assert tok.prompt_ids(body, "chat") == list(text.encode())
    # raise_exception in the template: this request fails, nothing else does
    with pytest.raises(TokenizerError, match="unknown role"):
        tok.prompt_ids({"messages": [{"role": "tool", "content": "x"}]}, "chat")
    with pytest.raises(TokenizerError):
        tok.prompt_ids({"messages": "hi"}, "chat")


def test_template_is_sandboxed(tmp_path: Path) -> None:
    # an unsafe template (reaching Python internals) fails per request, never runs
    write_tokenizer(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = PromptTokenizer.load(str(tmp_path))
    with pytest.raises(TokenizerError):
        tok.prompt_ids({"messages": [{"role": "user", "content": "x"}]}, "chat")
    # and one that mutates its input is refused by the immutable sandbox
    write_tokenizer(tmp_path, "{{ messages.append(1) }}")
    with pytest.raises(TokenizerError):
        PromptTokenizer.load(str(tmp_path)).prompt_ids({"messages": []}, "chat")


def test_unusable_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot read"):
        PromptTokenizer.load(str(tmp_path / "absent"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer"):
        PromptTokenizer.load(str(tmp_path))
    assert load_tokenizer(str(tmp_path)) is None  # logged once, then approximate


def test_router_falls_back_per_request(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    config = parse_proxy_config({
        "protocol": "vllm-nixl", "served_model_name": "m",
        "combined": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        "routing": {"policy": "kv-events", "tokenizer_dir": str(tmp_path)},
    })  # fmt: skip
    router = Router(config, Pool(config))
    ok = router.plan({"messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert ok.ids is not None and ok.tokens == len(ok.ids)
    bad = router.plan({"messages": [{"role": "tool", "content": "x" * 400}]}, "chat")
    assert bad.ids is None and bad.chunks  # matched over characters instead
    assert router.stats.paths == {"tokens": 1, "tokenizer-failed": 1, "approximate": 1}
    out: list[str] = []
    router.render(out)
    assert 'hgxserve_proxy_prompt_match_total{path="tokenizer-failed"} 1' in out
    assert json.loads(json.dumps(router.stats.paths))  # plain data for status
