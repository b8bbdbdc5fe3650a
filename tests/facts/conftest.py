"""Real command captures from /work/shared/fixtures/real (H20/H200/H100), header line stripped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(os.environ.get("HGX_REAL_FIXTURES", "/work/shared/fixtures/real"))


def load_capture(name: str) -> str:
    """Return a capture without its `# source: ...` header line."""
    text = (FIXTURES / name).read_text()
    first, _, rest = text.partition("\n")
    assert first.startswith("# source:"), f"{name}: missing source header"
    return rest


@pytest.fixture
def capture():
    if not FIXTURES.is_dir():
        pytest.skip(f"real captures not found at {FIXTURES} (set HGX_REAL_FIXTURES)")
    return load_capture
