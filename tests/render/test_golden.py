"""Golden renders: tests/golden/<topology>/<host>/<absolute path> for every example topology.

Regenerate after an intended change with `HGXSERVE_UPDATE_GOLDEN=1 pytest tests/render`, then
review the diff by hand against the seeds (git diff tests/golden).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, TEST_TOPOLOGIES

from hgxserve.render import render_topology
from hgxserve.topology import load_topology

GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = sorted((ROOT / "topologies").glob("**/*.yml"))
CASES = [(p, p.relative_to(ROOT / "topologies").with_suffix("")) for p in EXAMPLES] + [
    (p, Path("render-tests") / p.stem) for p in sorted(TEST_TOPOLOGIES.glob("*.yml"))
]
UPDATE = os.environ.get("HGXSERVE_UPDATE_GOLDEN") == "1"


def rendered_tree(path: Path) -> dict[str, str]:
    out = {}
    for host, rendered in render_topology(load_topology(path)).items():
        for file_path, item in rendered.files.items():
            out[f"{host}{file_path}"] = item.content
    return out


def golden_tree(base: Path) -> dict[str, str]:
    if not base.is_dir():
        return {}
    return {str(p.relative_to(base)): p.read_text() for p in sorted(base.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("path,name", CASES, ids=[str(n) for _, n in CASES])
def test_golden(path: Path, name: Path):
    base = GOLDEN / name
    tree = rendered_tree(path)
    if UPDATE:
        shutil.rmtree(base, ignore_errors=True)
        for rel, content in tree.items():
            target = base / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
    expected = golden_tree(base)
    assert expected, f"no golden render for {path.name}: run with HGXSERVE_UPDATE_GOLDEN=1"
    assert sorted(tree) == sorted(expected)
    for rel, content in tree.items():
        assert content == expected[rel], f"{rel} differs from tests/golden/{name}/{rel}"


def test_every_example_topology_has_a_golden_render():
    names = {str(n) for _, n in CASES}
    on_disk = {
        str(p.relative_to(GOLDEN).parent.parent) for p in GOLDEN.glob("**/etc") if p.is_dir()
    }
    assert on_disk <= names, f"stale golden renders: {sorted(on_disk - names)}"
