"""Escaping for systemd unit files: the one place a topology value becomes unit text.

systemd expands `%` specifiers in almost every setting and `$VAR` on command lines, so a literal
`%` is `%%` and a literal `$` on a command line is `$$`. A newline (or CR) ends a directive and a
trailing backslash continues it onto the next line, so neither may reach a unit: `unit_value`
refuses them. Words with spaces, quotes or backslashes are double-quoted with C-style escapes
(systemd.syntax(7), systemd.service(5) "Command lines"). Every value the unit templates print goes
through `unit_value` (the template environment's finalize), unless one of the functions here
already made it unit text.

>>> exec_line(["/opt/v/bin/vllm", "serve", '{"a":1}'])
'/opt/v/bin/vllm serve "{\\\\"a\\\\":1}"'
>>> environment_value("A", "x y%")
'"A=x y%%"'
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

_PLAIN = re.compile(r"\A[A-Za-z0-9_@%+=:,./-]+\Z")


class UnitValueError(ValueError):
    """A value cannot be written into a unit file without changing what the unit says."""


class UnitText(str):
    """Text already escaped for a unit file (printed by the templates as it is)."""

    __slots__ = ()


def unit_value(text: str) -> UnitText:
    """`text` as unit-file text: specifiers escaped; control characters and a trailing
    backslash (which would end or continue the line) refused.

    >>> unit_value("50% of GPUs")
    '50%% of GPUs'
    >>> unit_value("x\\ny")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    UnitValueError: 'x\\ny': control character U+000A in a unit value
    """
    if isinstance(text, UnitText):
        return text
    for ch in text:
        if unicodedata.category(ch) == "Cc" or ch in "\u2028\u2029":
            raise UnitValueError(f"{text!r}: control character U+{ord(ch):04X} in a unit value")
    if text.endswith("\\"):
        raise UnitValueError(f"{text!r}: a trailing backslash would continue the unit line")
    return UnitText(text.replace("%", "%%"))


def quote_word(word: str) -> UnitText:
    """One command-line word (or list item) as systemd reads it back unchanged."""
    unit_value(word.rstrip("\\"))  # refuses control characters; a trailing \ is quoted below
    if word and _PLAIN.match(word) and word != ";":
        return UnitText(unit_value(word).replace("$", "$$"))
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return UnitText(f'"{escaped}"')


def exec_line(argv: Iterable[str]) -> UnitText:
    """A whole ExecStart= value."""
    return UnitText(" ".join(quote_word(w) for w in argv))


def environment_value(name: str, value: str) -> UnitText:
    """The value of one `Environment=` line: `"NAME=value"` (no $ expansion there)."""
    unit_value(value.rstrip("\\"))
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return UnitText(f'"{unit_value(name)}={escaped}"')


def path_value(path: str) -> UnitText:
    """A path that is the rest of its line (LoadCredential=ID:PATH): read as written."""
    return unit_value(path)


def path_list(paths: Iterable[str], *, optional: bool = False) -> UnitText:
    """ReadOnlyPaths=/ReadWritePaths= value, one quoted word per path; `optional` prefixes `-`
    (a missing path is then ignored)."""
    prefix = "-" if optional else ""
    return UnitText(" ".join(prefix + quote_word(p) for p in paths))


def finalize(value: object) -> object:
    """The unit templates' finalize: every printed value is unit text."""
    if isinstance(value, str):
        return unit_value(value)
    return value
