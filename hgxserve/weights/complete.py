"""Is a verified tree a whole model? config, a tokenizer, and every shard its index names.

A manifest proves each listed file is intact, not that the list is a model: a tree published
without its tokenizer, or with one shard of 48 missing from the manifest, verifies file by file
and then fails minutes into an engine start. Checked before the marker is written.

    problems = completeness_problems({"config.json", "tokenizer.json", "model.safetensors"}, read)
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Iterable

from hgxserve.weights.errors import VerifyError
from hgxserve.weights.state import remove_marker

CONFIG = "config.json"
# what HF tokenizers load: fast (tokenizer.json), sentencepiece, tiktoken, BPE vocab, or a
# tokenizer_config.json that names the class
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "tiktoken.model",
    "vocab.json",
)
INDEX_SUFFIX = ".safetensors.index.json"


def read_small(dest: str) -> Callable[[str], bytes]:
    """A reader for files under `dest`, bounded (an index is a few MiB at most)."""

    def read(path: str) -> bytes:
        with open(posixpath.join(dest, path), "rb") as fh:
            data = fh.read(MAX_INDEX_BYTES + 1)
        if len(data) > MAX_INDEX_BYTES:
            raise ValueError(f"over {MAX_INDEX_BYTES} bytes")
        return data

    return read


MAX_INDEX_BYTES = 64 << 20


def completeness_problems(paths: Iterable[str], read: Callable[[str], bytes]) -> list[str]:
    """What is missing for `paths` (files of the model tree) to be a loadable checkpoint.

    `read(path)` returns a file's bytes (the safetensors indexes are read to see their shards).
    """
    present = set(paths)
    names = {posixpath.basename(p) for p in present}
    problems = []
    if CONFIG not in present:
        problems.append(f"{CONFIG} is missing: every checkpoint has one at its top level")
    if not names & set(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        problems.append(f"no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    indexes = sorted(p for p in present if p.endswith(INDEX_SUFFIX))
    weights = [p for p in present if p.endswith((".safetensors", ".bin", ".pt", ".gguf"))]
    if not indexes and not weights:
        problems.append("no weights: no *.safetensors (or .bin/.pt/.gguf) file")
    for index in indexes:
        try:
            weight_map = json.loads(read(index)).get("weight_map", {})
            named = {str(v) for v in weight_map.values()}
        except (OSError, ValueError, AttributeError) as exc:
            problems.append(f"{index}: not a readable safetensors index ({exc})")
            continue
        base = posixpath.dirname(index)
        missing = sorted(s for s in named if posixpath.join(base, s) not in present)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            problems.append(
                f"{index} names {len(missing)} shard(s) not in the model: "
                f"{', '.join(missing[:3])}{more}"
            )
    return problems


def check_complete(dest: str, paths: list[str], directory: str) -> None:
    """VerifyError (marker removed) unless `paths` under `dest` make a whole checkpoint."""
    problems = completeness_problems(paths, read_small(dest))
    if problems:
        remove_marker(directory)
        raise VerifyError(
            "the model is incomplete, nothing marked verified:\n  " + "\n  ".join(problems),
            hint="publish the whole checkpoint (and its manifest again); --allow-incomplete "
            "skips this check",
        )
