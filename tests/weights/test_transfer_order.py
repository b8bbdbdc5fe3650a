"""The order parts enter the download queue (hgxserve.weights.transfer._part_order)."""

from __future__ import annotations

from hgxserve.weights.transfer import SourceFile, _Job, _part_order

MIB = 1 << 20


def jobs(*sizes: int) -> list[_Job]:
    return [
        _Job(SourceFile(f"f{i}", size, "etag"), "/nonexistent", MIB) for i, size in enumerate(sizes)
    ]


def test_largest_files_interleaved_a_few_at_a_time_each_in_offset_order() -> None:
    js = jobs(3 * MIB, 64 << 10, 2 * MIB + 1, 0, 4 * MIB, 64 << 10)
    order = [(j.f.path, off) for j, off in _part_order(js, MIB, 2)]
    # f4 (4 MiB) and f0 (3 MiB) first, interleaved; f2 joins when f0 is done; small files last.
    assert order[:8] == [
        ("f4", 0),
        ("f0", 0),
        ("f4", MIB),
        ("f0", MIB),
        ("f4", 2 * MIB),
        ("f0", 2 * MIB),
        ("f4", 3 * MIB),
        ("f2", 0),
    ]
    # The small files join only as the big ones run out of parts.
    assert order.index(("f1", 0)) > order.index(("f4", 3 * MIB))
    assert order[-1] == ("f5", 0)
    # Every part of every non-empty file exactly once, and each file's parts in offset order:
    # that is what keeps the bounded buffer pool free of deadlock.
    expected = {
        f"f{i}": list(range(0, s, MIB))
        for i, s in enumerate([3 * MIB, 64 << 10, 2 * MIB + 1, 0, 4 * MIB, 64 << 10])
        if s
    }
    seen: dict[str, list[int]] = {}
    for path, off in order:
        seen.setdefault(path, []).append(off)
    assert seen == expected


def test_one_stream_is_file_by_file() -> None:
    order = [(j.f.path, off) for j, off in _part_order(jobs(2 * MIB, 2 * MIB), MIB, 1)]
    assert order == [("f0", 0), ("f0", MIB), ("f1", 0), ("f1", MIB)]
