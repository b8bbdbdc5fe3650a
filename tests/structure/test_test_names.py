"""pytest imports test modules by their base name (rootdir mode, no packages under tests/): two
test files with one name in different folders stop the whole run at collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_used_once():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    assert len(seen) > 50, "the scan finds the test modules"
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
