"""Problems found in a topology file, and how they are printed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

PathPart = str | int
JsonPath = tuple[PathPart, ...]
Severity = Literal["error", "warning"]

_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def format_path(path: Sequence[PathPart]) -> str:
    """Render a path as JSONPath: `$.engines.decode-0.place['h20-a'][3]` style.

    >>> format_path(("engines", "decode-0", "tp"))
    '$.engines.decode-0.tp'
    """
    out = "$"
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(part):
            out += f".{part}"
        else:
            out += "[" + json.dumps(part) + "]"
    return out


@dataclass(frozen=True)
class Problem:
    """One finding: where it is, which rule found it, and what would be right."""

    file: str
    line: int  # 1-based
    col: int  # 1-based
    path: JsonPath
    message: str
    rule: str = "schema"
    severity: Severity = "error"

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def text(self) -> str:
        tag = "" if self.is_error else "warning: "
        return f"{self.file}:{self.line}:{self.col}: {format_path(self.path)}: {tag}{self.message}"

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["path"] = format_path(self.path)
        return data


def sort_problems(problems: Iterable[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.file, p.line, p.col, p.rule, p.message))


class TopologyError(Exception):
    """A topology could not be loaded: unreadable, unparseable, or with errors."""

    def __init__(self, problems: Sequence[Problem], *, unreadable: bool = False) -> None:
        self.problems = list(problems)
        self.unreadable = unreadable
        super().__init__("\n".join(p.text() for p in self.problems))
