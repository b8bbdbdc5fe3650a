"""Links already in the destination are never written through (O_NOFOLLOW, directory fds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hgxserve.weights.errors import LocalIOError
from hgxserve.weights.sync import SyncOptions, sync


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_bytes(b'{"a": 1}')
    (src / "sub" / "w.bin").write_bytes(b"W" * 5000)
    return src


def _opts() -> SyncOptions:
    # a local tree with no manifest: the transfer is what is tested here
    return SyncOptions(
        require_sha256=False, require_complete=False, quiet=True, log=lambda line: None
    )


def test_a_linked_file_is_replaced_not_written_through(tmp_path: Path) -> None:
    src, dest, outside = _source(tmp_path), tmp_path / "dest", tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    dest.mkdir()
    os.symlink(outside, dest / "config.json")
    sync(str(src), str(dest), _opts())
    assert outside.read_bytes() == b"precious"
    assert not (dest / "config.json").is_symlink()
    assert (dest / "config.json").read_bytes() == b'{"a": 1}'


def test_a_linked_directory_stops_the_sync(tmp_path: Path) -> None:
    src, dest, elsewhere = _source(tmp_path), tmp_path / "dest", tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest.mkdir()
    os.symlink(elsewhere, dest / "sub")
    with pytest.raises(LocalIOError, match="symbolic link"):
        sync(str(src), str(dest), _opts())
    assert list(elsewhere.iterdir()) == []


def test_a_linked_partial_is_not_written_through(tmp_path: Path) -> None:
    src, dest, outside = _source(tmp_path), tmp_path / "dest", tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    (dest / "sub").mkdir(parents=True)
    os.symlink(outside, dest / "sub" / "w.bin.partial")
    with pytest.raises(LocalIOError, match="symbolic link"):
        sync(str(src), str(dest), _opts())
    assert outside.read_bytes() == b"keep"
