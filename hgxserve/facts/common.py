"""What the fact classes share: `Fact`, a FactBase whose value without output (its `default()`)
is the data `empty`; the `key value` lines their commands print; and the facts whose value is
the list of names a command prints one a line.

Example:
    >>> keyed_values(["loaded 550.90.12", "installed ", "other x"], ("loaded", "installed"))
    {'loaded': '550.90.12', 'installed': None}
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any, ClassVar

from pyinfra.api import FactBase


class Fact(FactBase):
    """A fact whose `default()` (its value when the command prints nothing pyinfra keeps, or is
    not run) is a fresh copy of the class's `empty`."""

    empty: ClassVar[Any] = None

    @classmethod
    def default(cls) -> Any:
        return copy.deepcopy(cls.empty)


def keyed_values(output: list[str], keys: Collection[str]) -> dict[str, str | None]:
    """The value after each of `keys` that starts a line (`key value`), None where it is empty;
    a key no line starts with is left out."""
    values: dict[str, str | None] = {}
    for line in output:
        key, _, value = line.partition(" ")
        if key in keys:
            values[key] = value.strip() or None
    return values


class NameList(Fact):
    """A fact whose command prints one name a line: its value is the names, sorted ([] for
    none)."""

    empty: ClassVar[list[str]] = []

    def process(self, output: list[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())
