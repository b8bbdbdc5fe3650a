"""docs/topology.md's rule table is what `hgxserve validate --list-rules --format markdown`
prints from the registry (each rule's id, severity, summary and why), and the README says how
many rules there are."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from hgxserve.cli.topology import validate
from hgxserve.topology.rules import RULES

REPO = Path(__file__).resolve().parents[2]
HEAD = "| id | severity | checks | why |"


def _docs_table() -> str:
    lines = (REPO / "docs" / "topology.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(HEAD)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def test_docs_rule_table_is_the_generated_one() -> None:
    result = CliRunner().invoke(validate, ["--list-rules", "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert _docs_table() == result.output, (
        "docs/topology.md's rule table differs: paste `hgxserve validate --list-rules "
        "--format markdown` over it"
    )


def test_markdown_lists_every_rule_once_with_its_why() -> None:
    output = CliRunner().invoke(validate, ["--list-rules", "--format", "markdown"]).output
    rows = output.splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == [f"| `{rule_id}`" for rule_id in sorted(RULES)]
    for rule_id, row in zip(sorted(RULES), rows, strict=True):
        assert row.endswith(f" | {RULES[rule_id].why} |")
        assert RULES[rule_id].why.strip() == RULES[rule_id].why != ""


def test_markdown_is_only_for_the_rule_list() -> None:
    result = CliRunner().invoke(validate, ["--format", "markdown", "any.yml"])
    assert result.exit_code == 2
    assert "--format markdown lists the rules" in result.output


def test_readme_counts_the_rules() -> None:
    readme = (REPO / "README.md").read_text()
    assert f"# {len(RULES)} rules: id, severity, why" in readme
