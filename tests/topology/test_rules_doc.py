"""docs/topology.md lists every rule with its registered severity and summary, and the README
says how many there are."""

from __future__ import annotations

import re
from pathlib import Path

from hgxserve.topology.rules import RULES

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([a-z0-9-]+)` \| (error|warning) \| ([^|]*) \|", re.MULTILINE)


def test_docs_list_every_rule_as_registered() -> None:
    rows = ROW.findall((REPO / "docs" / "topology.md").read_text())
    assert sorted(r[0] for r in rows) == sorted(RULES)
    for rule_id, severity, summary in rows:
        assert (severity, summary.strip()) == (RULES[rule_id].severity, RULES[rule_id].summary)


def test_readme_counts_the_rules() -> None:
    readme = (REPO / "README.md").read_text()
    assert f"# {len(RULES)} rules: id, severity, why" in readme
