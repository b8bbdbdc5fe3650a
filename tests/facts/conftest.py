"""Real command captures (tests/fixtures/real, from shared/fixtures/real), header stripped."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"  # copied from shared/


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
