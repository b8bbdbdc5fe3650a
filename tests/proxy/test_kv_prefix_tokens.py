"""Chat prompts tokenized from a remembered prefix: always the ids a whole tokenization gives,
used only for tokenizers that split at the template's special tokens, checked while in use."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from kvwire import write_bpe_tokenizer

from hgxserve.proxy import tokprefix
from hgxserve.proxy.tokens import PromptTokenizer

WORDS = "the cache holds keys and values of every prompt token for later turns"
WORDS += " ünï 42 ?!"


def whole(tok: PromptTokenizer, body: dict[str, Any]) -> list[int]:
    return tok.encode(tok.render_chat(body), special=False)


def conversations(rng: random.Random, n: int) -> list[dict[str, Any]]:
    words = WORDS.split()
    systems = [" ".join(rng.choices(words, k=200)) for _ in range(3)]
    out: list[dict[str, Any]] = []
    chats: list[list[dict[str, str]]] = []
    for _ in range(n):
        if chats and rng.random() < 0.5:  # the next turn of an earlier conversation
            msgs = rng.choice(chats)
            msgs += [{"role": "assistant", "content": " ".join(rng.choices(words, k=30))},
                     {"role": "user", "content": " ".join(rng.choices(words, k=10))}]  # fmt: skip
        else:  # a new one on a shared system prompt
            turn = "  " + " ".join(rng.choices(words, k=8))
            msgs = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": turn}]  # fmt: skip
            chats.append(msgs)
        out.append({"messages": [dict(m) for m in msgs]})
    return out


@pytest.fixture
def tok(tmp_path: Path) -> PromptTokenizer:
    """A BPE tokenizer that splits at special tokens: prefix reuse is on."""
    write_bpe_tokenizer(tmp_path)
    tok = PromptTokenizer.load(str(tmp_path))
    assert tok.prefix is not None
    return tok


def test_reuse_gives_exactly_the_whole_tokenization(tok: PromptTokenizer) -> None:
    assert tok.prefix is not None
    for body in conversations(random.Random(3), 300):
        assert tok.prompt_ids(body, "chat") == whole(tok, body)
    assert tok.prefix.hits > 250 and tok.prefix.mismatches == 0 and tok.prefix.enabled


def test_tokenizer_that_does_not_split_is_tokenized_whole(tmp_path: Path) -> None:
    # SentencePiece-like Metaspace(prepend_scheme="first"): the text after a special token
    # tokenizes differently alone, so the load-time check keeps reuse off
    write_bpe_tokenizer(tmp_path, metaspace=True)
    tok = PromptTokenizer.load(str(tmp_path))
    assert tok.prefix is None
    body = conversations(random.Random(1), 1)[0]
    assert tok.prompt_ids(body, "chat") == whole(tok, body)


def test_a_wrong_reuse_turns_it_off(tok: PromptTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tok.prefix
    assert cache is not None
    monkeypatch.setattr(tokprefix, "VERIFY_EVERY", 1)
    body = conversations(random.Random(2), 1)[0]
    tok.prompt_ids(body, "chat")
    for key, (ids, n) in list(cache.entries.items()):
        cache.entries[key] = ([i + 1 for i in ids], n)  # corrupt what is remembered
    assert tok.prompt_ids(body, "chat") == whole(tok, body)
    assert cache.mismatches == 1 and not cache.enabled


def test_memory_is_bounded(tok: PromptTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tok.prefix
    assert cache is not None
    monkeypatch.setattr(tokprefix, "MAX_CACHED_TOKENS", 5000)
    for body in conversations(random.Random(4), 200):
        assert tok.prompt_ids(body, "chat") == whole(tok, body)
        assert cache.tokens <= 5000
    held = {id(ids): len(ids) for ids, _ in cache.entries.values()}
    assert sum(held.values()) == cache.tokens and set(held) == set(cache.refs)


@pytest.mark.parametrize("metaspace", [False, True])
def test_ids_without_offsets_are_the_encode_ids(tmp_path: Path, metaspace: bool) -> None:
    # tokprefix.fast_ids (encode_batch_fast of one text) must give tokenizer.encode's ids, with
    # and without added special tokens (here a BOS by a post-processor), for any text
    from tokenizers import Tokenizer, processors

    write_bpe_tokenizer(tmp_path, metaspace=metaspace)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    rng = random.Random(5)
    pieces = [*WORDS.split(), "<|im_start|>", "<|im_end|>", "\n", "  ", "日本語", "🙂", "\t"]
    texts = ["", " ", "<|im_end|>"] + ["".join(rng.choices(pieces, k=rng.randint(1, 300)))
                                        for _ in range(200)]  # fmt: skip
    for text in texts:
        for special in (False, True):
            want = tok.encode(text, add_special_tokens=special).ids
            assert tokprefix.fast_ids(tok, text, special) == want
    assert tokprefix.fast_ids(tok, "the", True)[0] == bos  # the post-processor did run
