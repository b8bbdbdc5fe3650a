"""A bench dataset that is no file or that no parser survives: a FIFO (the read waited for a
writer forever), a device, a directory, JSON nested 100,000 deep (a RecursionError traceback),
an integer of more digits than Python converts. Each is a DatasetError naming the file."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from hgxserve.bench import dataset
from hgxserve.bench.scenario import Dataset

FORMATS = ("prompts", "sharegpt")


def load_within(path: Path, fmt: str, seconds: float = 10.0) -> BaseException | None:
    """What loading `path` raised (None: it loaded), failing the test if it did not end."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            dataset.load_dataset(Dataset(path, fmt), None)
            out["raised"] = None
        except BaseException as exc:  # noqa: BLE001 - the test reports what it was
            out["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"loading {path} as {fmt} did not end in {seconds}s"
    return out["raised"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fifo_device_or_directory_is_refused_without_waiting(tmp_path: Path, fmt: str) -> None:
    fifo = tmp_path / "data.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        raised = load_within(path, fmt)
        assert isinstance(raised, dataset.DatasetError), repr(raised)
        assert str(raised).startswith(f"{path}: not a regular file"), raised


@pytest.mark.parametrize("fmt", FORMATS)
def test_json_nested_past_the_recursion_limit_is_a_clear_error(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    raised = load_within(path, fmt)
    assert isinstance(raised, dataset.DatasetError), repr(raised)
    assert "nested too deeply" in str(raised) and str(path) in str(raised)
    if fmt == "prompts":
        assert str(raised).startswith(f"{path}:1:")


def test_an_integer_python_does_not_convert_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text('[{"conversations": [], "n": ' + "9" * 5000 + "}]\n")
    raised = load_within(path, "sharegpt")
    assert isinstance(raised, dataset.DatasetError), repr(raised)
    assert str(raised).startswith(f"{path}: not usable JSON")
    path.write_text('{"text": "a", "output_length": ' + "9" * 5000 + "}\n")
    raised = load_within(path, "prompts")
    assert isinstance(raised, dataset.DatasetError), repr(raised)
    assert str(raised).startswith(f"{path}:1:")
