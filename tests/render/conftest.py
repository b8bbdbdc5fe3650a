"""Shared helpers for render tests: load topologies, split argv into (flag, value) pairs."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

import pytest

from hgxserve.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TEST_TOPOLOGIES = HERE / "topologies"


def topology(name: str):
    """A topology from topologies/ (name with .yml) or tests/render/topologies/."""
    for base in (ROOT / "topologies", TEST_TOPOLOGIES):
        path = base / name
        if path.is_file():
            return load_topology(path)
    raise FileNotFoundError(name)


def flag_pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    """[--a, 1, --b, --c, x] -> [(--a, 1), (--b, None), (--c, x)]; the model path is dropped."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("-"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            pairs.append((word, value))
            i += 2 if value is not None else 1
        else:
            i += 1
    return pairs


def seed_argv(text: str) -> list[str]:
    """A seed's shell command (continuations allowed) as argv."""
    return shlex.split(text.replace("\\\n", " "))


@pytest.fixture
def root() -> Path:
    return ROOT


def kv_demo_pd():  # -> Topology
    """demo-pd routed with policy kv-events (the demo itself routes least-outstanding)."""
    text = (ROOT / "topologies/demo/demo-pd.yml").read_text()
    assert "    policy: least-outstanding" in text
    path = Path(tempfile.mkdtemp(prefix="demo-pd-kv-")) / "demo-pd.yml"
    path.write_text(text.replace("    policy: least-outstanding", "    policy: kv-events"))
    return load_topology(path)
