"""Product code is held to ruff's default complexity limits (pyproject.toml); the functions that
take more arguments say why on their def line, and no function is exempt from the others."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOQA = re.compile(r"#\s*noqa:\s*([A-Z0-9, ]+?)\s*(?:-\s*(\S.*))?$")
LIMITS = ("C901", "PLR0911", "PLR0912", "PLR0913", "PLR0915")


def _exemptions() -> list[tuple[str, int, set[str], str]]:
    found = []
    for package in ("hgxserve", "roles", "deploys"):
        for path in sorted((REPO / package).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                match = NOQA.search(line)
                if not match:
                    continue
                codes = {c.strip() for c in match.group(1).split(",")} & set(LIMITS)
                if codes:
                    rel = str(path.relative_to(REPO))
                    found.append((rel, number, codes, (match.group(2) or "").strip()))
    return found


def test_the_limits_are_ruffs_defaults():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    for setting in (
        "max-complexity = 10",
        "max-args = 5",
        "max-branches = 12",
        "max-returns = 6",
        "max-statements = 50",
    ):
        assert setting in text


def test_every_exemption_is_an_argument_count_with_its_reason():
    exemptions = _exemptions()
    assert exemptions, "the scan finds the exemptions it is meant to check"
    for path, line, codes, reason in exemptions:
        assert codes == {"PLR0913"}, f"{path}:{line}: exempt from {codes}: split the function"
        assert len(reason) >= 20, f"{path}:{line}: noqa {codes} without its reason"


def test_the_readme_counts_the_exemptions():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"{len(_exemptions())} take more than 5 arguments" in readme
