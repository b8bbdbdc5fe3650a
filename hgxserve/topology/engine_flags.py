"""The flags each engine's `serve` parser takes, and extra_args read the way that parser reads them.

A rule that looks for a flag by the text written would miss the other spellings the engine takes
for it: vLLM turns `_` into `-` in a flag's name (up to the first `.`), takes `--flag.key=value`
as one sub-key of a JSON flag, and `-O3` as `--optimization-level 3`; argparse takes any
unambiguous prefix of a flag (`--trust-remote` is `--trust-remote-code`). `read_extra_args`
resolves every flag of an engine's extra_args to the one the engine takes it for, against the
flag lists in `engine_flags.json` (read from the engines' own source; the file names which), so
the rules compare resolved flags, and the `extra-args-known` rule refuses what resolves to no
single flag.

>>> args = ["--trust_remote", "--kv-transfer-config.x=1"]
>>> [(f.flag, f.subkey) for f in read_extra_args("vllm", args)]
[('--trust-remote-code', ''), ('--kv-transfer-config', 'x')]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from hgxserve.topology.engine_args import EngineKind

FLAGS_FILE = Path(__file__).with_name("engine_flags.json")


@cache
def known_flags(engine: EngineKind) -> frozenset[str]:
    """Every option string the engine's serve parser registers (engine_flags.json)."""
    data = json.loads(FLAGS_FILE.read_text(encoding="utf-8"))
    return frozenset(data[engine])


def flags_source(engine: EngineKind) -> str:
    """Where engine_flags.json's list for the engine was read from."""
    data = json.loads(FLAGS_FILE.read_text(encoding="utf-8"))
    return str(data["sources"][engine])


@dataclass(frozen=True)
class ExtraFlag:
    """One flag of extra_args as the engine's parser reads it.

    `written` is the flag as the topology wrote it (before any `=`); `name` the name the parser
    matches (vLLM's `_` -> `-` applied, any `.sub.key` cut off); `flag` the one flag it resolves
    to (None: none or several, listed in `candidates`); `subkey` a vLLM dotted sub-key; `value`
    the value given with `=` or as the next item (empty when none)."""

    index: int
    written: str
    name: str
    flag: str | None
    candidates: tuple[str, ...]
    subkey: str
    value: str

    @property
    def abbreviated(self) -> bool:
        """Whether the parser takes it for a longer flag than the name written."""
        return self.flag is not None and self.flag != self.name and not self.short_o

    @property
    def short_o(self) -> bool:
        """vLLM's `-O<level>` / `-O <level>` form of --optimization-level."""
        return self.flag == "--optimization-level" and self.name.startswith("-O")


def _normal_name(written: str) -> tuple[str, str]:
    """(name, subkey): `_` -> `-` in a long flag's name before the first `.` (vLLM does it; an
    SGLang parser would refuse the `_` spelling, which is then read as vLLM would) and the
    dotted sub-key cut off."""
    name, _, subkey = written.partition(".")
    if not written.startswith("--"):
        return name, subkey  # vLLM takes `-cc.key=value` too
    return name.replace("_", "-"), subkey


def resolve(engine: EngineKind, name: str) -> tuple[str | None, tuple[str, ...]]:
    """(the flag the parser takes `name` for, or None; the flags it could be).

    An exact flag is itself; otherwise argparse takes a prefix of exactly one flag as that flag
    (a prefix of several is an error at start, of none an unknown flag); vLLM takes `-O3` for
    `--optimization-level 3`."""
    known = known_flags(engine)
    if name in known:
        return name, (name,)
    if engine == "vllm" and name.startswith("-O") and not name.startswith("--"):
        return "--optimization-level", ("--optimization-level",)
    if len(name) < 2 or name in ("--",) or not name.startswith("-"):
        return None, ()
    matches = tuple(sorted(k for k in known if k.startswith(name)))
    if len(matches) == 1:
        return matches[0], matches
    return None, matches


def is_flag(item: str) -> bool:
    """Whether an extra_args item is a flag (not a value: `-1` and `-0.5` are numbers)."""
    if not item.startswith("-") or item == "-":
        return False
    try:
        float(item)
    except ValueError:
        return True
    return False


def read_extra_args(engine: EngineKind, args: Sequence[str]) -> list[ExtraFlag]:
    """Every flag of `args` (an engine's extra_args, defaults' first), resolved."""
    found = []
    for i, item in enumerate(args):
        if not isinstance(item, str) or not is_flag(item):
            continue
        written, eq, value = item.partition("=")
        following = args[i + 1] if i + 1 < len(args) else None
        if not eq and isinstance(following, str) and not is_flag(following):
            value = following
        name, subkey = _normal_name(written)
        flag, candidates = resolve(engine, name)
        found.append(ExtraFlag(i, written, name, flag, candidates, subkey, value))
    return found
