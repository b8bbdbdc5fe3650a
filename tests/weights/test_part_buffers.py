"""A sync holds no more part memory than its parts need: 32 workers each made a zero-filled
32 MiB buffer before they took a part, so a 3 KB model peaked at ~1 GiB RSS. Buffers are no
larger than the largest part, there are no more workers than parts, and buffers are reused."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from pathlib import Path

from hgxserve.weights import transfer
from hgxserve.weights.sync import SyncOptions, sync
from hgxserve.weights.transfer import SourceFile, Transfer, TransferOptions

MIB = 1 << 20


def _tree(root: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    root.mkdir(parents=True)
    out = {}
    for name, size in sizes.items():
        data = os.urandom(size)
        (root / name).write_bytes(data)
        out[name] = data
    return out


def test_a_3_kb_model_syncs_without_part_sized_buffers(tmp_path: Path) -> None:
    files = _tree(
        tmp_path / "src", {"config.json": 100, "tokenizer.json": 2000, "model.safetensors": 900}
    )
    tracemalloc.start()
    try:
        report = sync(
            str(tmp_path / "src"),
            str(tmp_path / "dst"),
            SyncOptions(
                concurrency=32,
                part_size=32 * MIB,
                manifest="none",
                require_sha256=False,
                require_complete=False,
                quiet=True,
                engine="python",
                fsync=False,
                log=lambda _: None,
            ),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB, f"{peak / MIB:.1f} MiB traced at the peak for 3 KB of files"
    for name, data in files.items():
        assert (tmp_path / "dst" / name).read_bytes() == data
    assert report.marker and not report.errors


def test_buffers_are_the_largest_part_and_workers_the_parts(tmp_path: Path) -> None:
    from hgxserve.weights.sources import LocalSource

    sizes = {"a.bin": 3 * MIB + 5, "b.bin": 10, "c.bin": 0}
    files = _tree(tmp_path / "src", sizes)
    wanted = [
        SourceFile(n, s, "x", hashlib.sha256(files[n]).hexdigest(), "manifest")
        for n, s in sizes.items()
    ]
    made: list[int] = []
    real_get = transfer._BufferPool.get

    def counting_get(self: transfer._BufferPool) -> bytearray:
        with self._lock:
            fresh = not self._free
        buf = real_get(self)
        if fresh:
            made.append(len(buf))
        return buf

    source = LocalSource(str(tmp_path / "src"))
    (tmp_path / "d1").mkdir()
    big = Transfer(source, str(tmp_path / "d1"), wanted, TransferOptions(32, part_size=MIB))
    assert big.concurrency == 5 and big.buffer_size == MIB  # a.bin: 4 parts, b.bin: 1
    small = Transfer(source, str(tmp_path / "d2"), wanted[1:], TransferOptions(32, 32 * MIB))
    assert small.concurrency == 1 and small.buffer_size == 10
    transfer._BufferPool.get = counting_get  # type: ignore[method-assign]
    try:
        results = big.run()
    finally:
        transfer._BufferPool.get = real_get  # type: ignore[method-assign]
    assert all(r.error is None for r in results)
    assert len(made) <= big.concurrency + 2 and set(made) == {MIB}
    for name, data in files.items():
        assert (tmp_path / "d1" / name).read_bytes() == data
