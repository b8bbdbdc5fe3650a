"""Quoting for systemd unit files: command lines and Environment= assignments.

systemd expands `%` specifiers everywhere and `$VAR` on command lines, so a literal `%` is `%%`
and a literal `$` on a command line is `$$`. Words with spaces, quotes or backslashes are
double-quoted with C-style escapes (systemd.syntax(7), systemd.service(5) "Command lines").

>>> exec_line(["/opt/v/bin/vllm", "serve", '{"a":1}'])
'/opt/v/bin/vllm serve "{\\\\"a\\\\":1}"'
>>> environment_value("A", "x y%")
'"A=x y%%"'
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def _escape_specifiers(text: str) -> str:
    return text.replace("%", "%%")


def quote_word(word: str) -> str:
    """One command-line word as systemd reads it back unchanged."""
    if word and _PLAIN.match(word) and word != ";":
        return _escape_specifiers(word).replace("$", "$$")
    escaped = (
        word.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\t", "\\t")
        .replace("%", "%%")
        .replace("$", "$$")
    )
    return f'"{escaped}"'


def exec_line(argv: Iterable[str]) -> str:
    """A whole ExecStart= value."""
    return " ".join(quote_word(w) for w in argv)


def environment_value(name: str, value: str) -> str:
    """The value of one `Environment=` line: `"NAME=value"` (no $ expansion there)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    escaped = escaped.replace("\n", "\\n")
    return f'"{name}={escaped}"'


def path_value(path: str) -> str:
    """A path in ReadOnlyPaths= and similar (specifiers expanded there too)."""
    return _escape_specifiers(path)
