"""Golden monitoring renders: tests/golden/monitoring/<topology>/ holds what
`hgxserve monitoring render` writes for a P/D vLLM topology with monitoring (the test one), a
seed's 2-node P/D topology and an SGLang P/D topology.

Regenerate after an intended change with `HGXSERVE_UPDATE_GOLDEN=1 pytest tests/monitoring`,
then review the diff (git diff tests/golden/monitoring).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hgxserve.monitoring.render import render_tree
from hgxserve.topology import load_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GOLDEN = REPO / "tests/golden/monitoring"
CASES = [
    HERE / "demo-pd-monitored.yml",
    REPO / "topologies/h200-dsv32-2p1d.yml",
    REPO / "topologies/h20-v4flash-sglang-1p1d.yml",
]
UPDATE = os.environ.get("HGXSERVE_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_golden(path: Path) -> None:
    base = GOLDEN / path.stem
    tree = render_tree(load_topology(str(path)))
    if UPDATE:
        shutil.rmtree(base, ignore_errors=True)
        for rel, text in tree.items():
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(text)
    expected = {str(p.relative_to(base)): p.read_text() for p in base.rglob("*") if p.is_file()}
    assert expected, f"no golden render for {path.name}: run with HGXSERVE_UPDATE_GOLDEN=1"
    assert sorted(tree) == sorted(expected)
    for rel, text in tree.items():
        assert text == expected[rel], f"{rel} differs from tests/golden/monitoring/{path.stem}"
