"""Model completeness: config, a tokenizer, and every shard the safetensors index names."""

from __future__ import annotations

import json

from hgxserve.weights.complete import completeness_problems

INDEX = json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}).encode()


def _read(path: str) -> bytes:
    assert path.endswith(".index.json")
    return INDEX


def test_whole_checkpoint_has_no_problems() -> None:
    files = {"config.json", "tokenizer.json", "model.safetensors.index.json"}
    files |= {"m-1.safetensors", "m-2.safetensors"}
    assert completeness_problems(files, _read) == []


def test_each_missing_part_is_named() -> None:
    problems = completeness_problems({"model.safetensors.index.json", "m-1.safetensors"}, _read)
    text = "\n".join(problems)
    assert "config.json is missing" in text
    assert "no tokenizer" in text
    assert "m-2.safetensors" in text and "m-1.safetensors" not in text.split("names")[1]


def test_no_weights_at_all() -> None:
    assert any(
        "no weights" in p for p in completeness_problems({"config.json", "vocab.json"}, _read)
    )


def test_unreadable_index_is_a_problem_not_a_traceback() -> None:
    def broken(path: str) -> bytes:
        return b"{not json"

    problems = completeness_problems(
        {"config.json", "tokenizer.json", "x.safetensors.index.json"}, broken
    )
    assert any("not a readable safetensors index" in p for p in problems)
