"""Escaping for systemd unit files: the one place a topology value becomes unit text.

systemd expands `%` specifiers in almost every setting and `$VAR` on command lines, so a literal
`%` is `%%` and a literal `$` on a command line is `$$`. A newline (or CR) ends a directive and a
trailing backslash continues it onto the next line, so neither may reach a unit: `unit_value`
refuses them. Words with spaces, quotes or backslashes are double-quoted with C-style escapes
(systemd.syntax(7), systemd.service(5) "Command lines"), control characters inside them as C
escapes. Every value the unit templates print goes through `unit_value` (the template
environment's finalize) unless a function here already made it unit text (`UnitText`).

>>> exec_line(["/opt/v/bin/vllm", "serve", '{"a":1}'])
'/opt/v/bin/vllm serve "{\\\\"a\\\\":1}"'
>>> environment_value("A", "x y%")
'"A=x y%%"'
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Iterable

_PLAIN = re.compile(r"\A[A-Za-z0-9_@%+=:,./-]+\Z")
_MOUNT_SAFE = set(string.ascii_letters + string.digits + ":_.")


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
    """One command-line word (or list item) as systemd reads it back unchanged; inside the
    quotes, control characters are C escapes (`\\n`, `\\x1b`), never a raw line break."""
    if word and _PLAIN.match(word) and word != ";":
        return UnitText(unit_value(word).replace("$", "$$"))
    return UnitText(f'"{_c_escape(word).replace("$", "$$")}"')


def _c_escape(text: str) -> str:
    out = []
    for ch in text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%"):
        if ch in _C_ESCAPES:
            out.append(_C_ESCAPES[ch])
        elif unicodedata.category(ch) == "Cc" or ch in "\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}" if ord(ch) > 0xFF else f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


_C_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def exec_line(argv: Iterable[str]) -> UnitText:
    """A whole ExecStart= value."""
    return UnitText(" ".join(quote_word(w) for w in argv))


def signal_main_pid(kill: str, signal: str) -> UnitText:
    """An ExecReload= value that sends `signal` to the unit's main process: the one place
    systemd's `$MAINPID` is written unescaped.

    >>> signal_main_pid("/bin/kill", "HUP")
    '/bin/kill -s HUP $MAINPID'
    """
    return UnitText(exec_line([kill, "-s", signal]) + " $MAINPID")


def environment_value(name: str, value: str) -> UnitText:
    """The value of one `Environment=` line: `"NAME=value"` (no $ expansion there)."""
    return UnitText(f'"{unit_value(name)}={_c_escape(value)}"')


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


def mount_unit_name(where: str) -> str:
    """systemd's escaped unit name for a mount point (`systemd-escape --path --suffix=mount`).

    mount_unit_name("/mnt/hgxserve-models")  # "mnt-hgxserve\\x2dmodels.mount"
    """
    path = where.strip("/")
    if not path:
        return "-.mount"
    out = []
    for i, ch in enumerate(path):
        if ch == "/":
            out.append("-")
        elif ch in _MOUNT_SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out) + ".mount"
