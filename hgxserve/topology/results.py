"""A check's results as `validate` shows them: every problem as `file:line:col: $.path:
message`, the summary line, the JSON report, the exit code; and the rule table.

Exit codes: 0 valid, 1 errors (or warnings with strict), 2 a file could not be read or parsed.

    results = [safe_check("topologies/h20-v4flash-tp8.yml")]
    print("\n".join(problems_text(results, strict=False)))
    sys.exit(exit_code(results, strict=False))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hgxserve.base.errors import ExitCode
from hgxserve.topology import CheckResult, check_topology
from hgxserve.topology.problems import Problem, sort_problems
from hgxserve.topology.registry import Rule

EXIT_OK, EXIT_ERRORS, EXIT_UNREADABLE = ExitCode.OK, ExitCode.FOUND, ExitCode.USAGE


def safe_check(path: str) -> CheckResult:
    """check_topology, with any unexpected failure turned into a problem (exit 2)."""
    try:
        return check_topology(path)
    except Exception as exc:  # noqa: BLE001  (a bug must still not print a traceback)
        message = f"internal error while checking this file: {type(exc).__name__}: {exc}"
        return CheckResult(path, None, [Problem(path, 1, 1, (), message, "internal")], True)


def exit_code(results: Sequence[CheckResult], strict: bool) -> int:
    if any(r.unreadable for r in results):
        return EXIT_UNREADABLE
    if any(r.errors for r in results):
        return EXIT_ERRORS
    if strict and any(r.warnings for r in results):
        return EXIT_ERRORS
    return EXIT_OK


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary(results: Sequence[CheckResult], strict: bool) -> str:
    errors = sum(len(r.errors) for r in results)
    warnings = sum(len(r.warnings) for r in results)
    unreadable = sum(1 for r in results if r.unreadable)
    valid = sum(1 for r in results if not r.unreadable and not r.errors)
    text = (
        f"{_plural(len(results), 'file')} checked: {valid} valid, "
        f"{len(results) - valid} invalid; {_plural(errors, 'error')}, "
        f"{_plural(warnings, 'warning')}"
    )
    if unreadable:
        text += f" ({unreadable} unreadable)"
    if strict and warnings and not errors:
        text += " (--strict: warnings fail)"
    return text


def results_json(results: Sequence[CheckResult], strict: bool) -> dict[str, Any]:
    return {
        "files": [
            {
                "file": r.file,
                "valid": not r.unreadable and not r.errors,
                "unreadable": r.unreadable,
                "errors": len(r.errors),
                "warnings": len(r.warnings),
                "problems": [p.to_json() for p in r.problems],
            }
            for r in results
        ],
        "errors": sum(len(r.errors) for r in results),
        "warnings": sum(len(r.warnings) for r in results),
        "strict": strict,
        "exit_code": exit_code(results, strict),
    }


def problems_text(results: Sequence[CheckResult], strict: bool) -> list[str]:
    """Every problem, sorted, then the summary line."""
    problems = sort_problems(p for r in results for p in r.problems)
    return [*(problem.text() for problem in problems), summary(results, strict)]


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def rules_markdown(rules: Sequence[Rule]) -> str:
    """The rule table of docs/topology.md: id, severity, what it checks, why."""
    lines = ["| id | severity | checks | why |", "|---|---|---|---|"]
    for r in rules:
        cells = (f"`{r.id}`", r.severity, r.summary, r.why)
        lines.append("| " + " | ".join(_markdown_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def rules_text(fmt: str) -> str:
    """Every rule's id, severity and summary (text), or also why (json, markdown)."""
    from hgxserve.topology.rules import RULES

    rules = sorted(RULES.values(), key=lambda r: r.id)
    if fmt == "json":
        data = [
            {"id": r.id, "severity": r.severity, "summary": r.summary, "why": r.why} for r in rules
        ]
        return json.dumps(data, indent=2)
    if fmt == "markdown":
        return rules_markdown(rules)
    width = max(len(r.id) for r in rules)
    return "\n".join(f"{r.id:<{width}}  {r.severity:<7}  {r.summary}" for r in rules)
