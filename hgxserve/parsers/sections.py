"""The one splitter of `##name`-marked command output, which several facts' commands print.

A command prints `##name` before each part of its output and, where the exit status matters,
`##rc N` after it: `echo '##query'; nvidia-smi --query-gpu=...; echo "##rc $?"`.
"""

from __future__ import annotations

from typing import Any


def split_sections(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Split `##name` ... [`##rc N`] marked output into {name: {"lines": [...], "rc": N}}.

    `rc` is None for a section no `##rc` line closed; lines before the first marker and
    between an `##rc` line and the next marker belong to no section. `##absent TOOL` lines
    become {"absent TOOL": {"lines": [], "rc": None}}.

    Example:
        >>> split_sections(["##query", "a", "##rc 0", "##state", "{}"])
        {'query': {'lines': ['a'], 'rc': 0}, 'state': {'lines': ['{}'], 'rc': None}}
    """
    sections: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in lines:
        if line.startswith("##rc ") and current is not None:
            current["rc"] = int(line[5:].strip() or 0)
            current = None
        elif line.startswith("##"):
            current = {"lines": [], "rc": None}
            sections[line[2:].strip()] = current
        elif current is not None:
            current["lines"].append(line)
    return sections


def section_text(sections: dict[str, dict[str, Any]], name: str, sep: str = "\n") -> str:
    """The lines of section `name` joined with `sep` ("" when it is missing).

    Example:
        >>> section_text({"marker": {"lines": ["sha256:ab"], "rc": None}}, "marker")
        'sha256:ab'
    """
    section = sections.get(name)
    return sep.join(section["lines"]) if section else ""
