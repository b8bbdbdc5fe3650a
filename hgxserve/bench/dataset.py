"""Prompts from a file, replayed by the load generator (AIPerf's `single_turn` JSONL input).

Two formats, named by the scenario's `dataset.format`:

- `prompts`: JSONL, one object a line: `{"text": "...", "output_length": 128}` (`prompt` is
  taken for `text`; `output_length` optional);
- `sharegpt`: the ShareGPT conversations file the seeds use (seed 002:
  ShareGPT_V3_unfiltered_cleaned_split.json), a JSON array of `{"conversations": [{"from":
  "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`: the first human turn is the
  prompt, the reply that follows gives the output length (its characters / 4, as the proxy
  estimates tokens) unless the scenario fixes `output`; conversations without both are skipped,
  as `vllm bench serve --dataset-name sharegpt` skips them.

Reads are bounded (BENCH_DATASET_MAX_BYTES, BENCH_DATASET_MAX_LINES), only regular files are read
(a FIFO or device is refused, not waited on) and JSON nested past the recursion limit is an
error, not a traceback; every error names the file and its line (and column).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from hgxserve.base.defaults import BENCH_DATASET_MAX_BYTES, BENCH_DATASET_MAX_LINES
from hgxserve.base.errors import UsageError
from hgxserve.bench.scenario import Dataset

MAX_OUTPUT = 1048576  # the scenario schema's bound on output tokens
CHARS_PER_TOKEN = 4


class DatasetError(UsageError):
    """A dataset file that cannot be used; the message names the file and line."""


def _read(path: Path) -> str:
    """The dataset's text: a regular file (opened without blocking: a FIFO or a device is
    refused, never waited on or read forever) of at most BENCH_DATASET_MAX_BYTES, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the dataset ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(
                f"{path}: not a regular file (a FIFO, device, directory or socket); a dataset "
                "is a file"
            )
        if info.st_size > BENCH_DATASET_MAX_BYTES:
            raise DatasetError(
                f"{path}: {info.st_size} bytes, more than the {BENCH_DATASET_MAX_BYTES} a "
                "dataset may have"
            )
        chunks, size = [], 0
        while size <= BENCH_DATASET_MAX_BYTES:
            chunk = os.read(fd, min(1 << 24, BENCH_DATASET_MAX_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the dataset ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if size > BENCH_DATASET_MAX_BYTES:
        raise DatasetError(f"{path}: more than {BENCH_DATASET_MAX_BYTES} bytes")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 at byte {exc.start}") from None


def _too_deep(where: str) -> DatasetError:
    return DatasetError(
        f"{where}: JSON nested too deeply to read (Python's recursion limit, "
        f"{sys.getrecursionlimit()}); a dataset entry is an object of strings and numbers"
    )


def _output_length(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT:
        raise DatasetError(f"{where}: output_length must be an integer 1..{MAX_OUTPUT}")
    return value


def _prompt_entry(where: str, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise DatasetError(f"{where}:{getattr(exc, 'colno', 1)}: not JSON ({exc})") from None
    except RecursionError:
        raise _too_deep(where) from None
    if not isinstance(obj, dict):
        raise DatasetError(f'{where}: want an object with "text"')
    text = obj.get("text", obj.get("prompt"))
    if not isinstance(text, str) or not text:
        raise DatasetError(f'{where}: want a non-empty string "text" (or "prompt")')
    entry: dict[str, Any] = {"text": text}
    if "output_length" in obj:
        entry["output_length"] = _output_length(where, obj["output_length"])
    return entry


def prompts_entries(path: Path, limit: int | None) -> list[dict[str, Any]]:
    entries = []
    lines = _read(path).splitlines()
    if len(lines) > BENCH_DATASET_MAX_LINES:
        raise DatasetError(f"{path}: more than {BENCH_DATASET_MAX_LINES} lines")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        entries.append(_prompt_entry(f"{path}:{number}", line))
        if limit is not None and len(entries) >= limit:
            break
    return entries


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _sharegpt_pair(conv: Any) -> tuple[str, str] | None:
    """(first human turn, the reply after it), or None when the conversation has not both."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        nxt = turns[i + 1]
        if (
            isinstance(turn, dict)
            and isinstance(nxt, dict)
            and turn.get("from") == "human"
            and nxt.get("from") == "gpt"
            and isinstance(turn.get("value"), str)
            and isinstance(nxt.get("value"), str)
            and turn["value"]
        ):
            return turn["value"], nxt["value"]
    return None


def sharegpt_entries(path: Path, limit: int | None) -> tuple[list[dict[str, Any]], int]:
    """The prompts of a ShareGPT file and how many conversations were skipped."""
    text = _read(path)
    if text.count("\n") > BENCH_DATASET_MAX_LINES:
        raise DatasetError(f"{path}: more than {BENCH_DATASET_MAX_LINES} lines")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise DatasetError(f"{path}: not usable JSON ({exc})") from None
    except RecursionError:
        raise _too_deep(str(path)) from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}:1: want a JSON array of conversations (ShareGPT)")
    entries, skipped = [], 0
    for conv in data:
        pair = _sharegpt_pair(conv)
        if pair is None:
            skipped += 1
            continue
        prompt, reply = pair
        length = max(1, min(MAX_OUTPUT, len(reply) // CHARS_PER_TOKEN))
        entries.append({"text": prompt, "output_length": length})
        if limit is not None and len(entries) >= limit:
            break
    return entries, skipped


def load_dataset(ds: Dataset, output: int | None) -> tuple[list[dict[str, Any]], int]:
    """The entries to replay (`text`, `output_length`) and the conversations skipped; a fixed
    `output` replaces every entry's own length."""
    if ds.format == "sharegpt":
        entries, skipped = sharegpt_entries(ds.path, ds.limit)
    else:
        entries, skipped = prompts_entries(ds.path, ds.limit), 0
    if not entries:
        raise DatasetError(f"{ds.path}: no usable prompt ({skipped} conversation(s) skipped)")
    for entry in entries:
        if output is not None:
            entry["output_length"] = output
        elif "output_length" not in entry:
            raise DatasetError(
                f"{ds.path}: an entry has no output_length and the scenario no output: give one"
            )
    return entries, skipped


def write_input(entries: list[dict[str, Any]], path: Path) -> Path:
    """AIPerf's `single_turn` JSONL (`--custom-dataset-type single_turn --input-file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for entry in entries:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
    return path
