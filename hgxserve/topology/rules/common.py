"""What several rule modules share: version parsing and comparison, GPU kinds, the P/D pairs the
proxy joins, and the accept-by-path hint of the rules whose findings are accepted one by one
(`ITEM_ACCEPTABLE`). Registers no rule.

A topology is untrusted input: environment variables, engine flags, packages and shipped files
that run code inside the engine (as the user the engine runs as), or ship any controller file,
are refused unless the topology accepts each one by its path, with a reason (`accept:`), which
`plan` prints. Everything else a topology says is data.

    accept:
      "$.engines.decode-0.env.LD_PRELOAD": "jemalloc, reviewed by the platform team"

`ITEM_ACCEPTABLE` names the rules whose errors an `accept:` entry may lift, one finding at a
time: the code-loading rules, a flag the engine's flag list lacks (`extra-args-known`) and a
firewall.allow network wider than the bound (`firewall-wide`); no other error can be accepted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from hgxserve.topology.engine_flags import ExtraFlag, read_extra_args
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.problems import JsonPath, format_path

HOPPER = ("H20", "H20-3e", "H100", "H800", "H200")
BLACKWELL = ("B200",)

ITEM_ACCEPTABLE = ("env-loads-code", "env-family", "args-load-code", "package-known",
                   "file-source-place", "extra-args-known", "firewall-wide")  # fmt: skip


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version such as 0.15.0 or 0.14 (None when it has none)."""
    if text is None:
        return None
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(g or 0) for g in match.groups())


def older_than(engine: Engine, release: tuple[int, ...]) -> bool:
    """Whether the engine states a version, older than `release` (no stated version: False)."""
    version = parse_version(engine.version)
    return version is not None and version < release


def at_least(engine: Engine, release: tuple[int, ...]) -> bool:
    """Whether the engine states a version, `release` or newer (no stated version: False)."""
    version = parse_version(engine.version)
    return version is not None and version >= release


def show_version(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def gpu_kinds(topo: Topology, engine: Engine) -> list[str]:
    """The GPU kinds of the (known) hosts an engine runs on, sorted."""
    return sorted({topo.hosts[h].gpu for h in engine.hosts if h in topo.hosts})


def pd_pairs(topo: Topology) -> list[tuple[int | None, Engine, Engine]]:
    """(route index, prefill, decode) for every pair the proxy can join.

    Without proxy routes every prefill is paired with every decode (for the agreement rules).
    """
    pairs: list[tuple[int | None, Engine, Engine]] = []
    seen: set[tuple[str, str]] = set()
    engines = topo.engines
    if topo.proxy is not None and topo.proxy.routes:
        for index, route in enumerate(topo.proxy.routes):
            for p in route.prefill:
                for d in route.decode:
                    pe, de = engines.get(p), engines.get(d)
                    if pe is None or de is None or (p, d) in seen:
                        continue
                    if pe.role == "prefill" and de.role == "decode":
                        seen.add((p, d))
                        pairs.append((index, pe, de))
        return pairs
    for pe in engines.values():
        for de in engines.values():
            if pe.role == "prefill" and de.role == "decode":
                pairs.append((None, pe, de))
    return pairs


def cross_host(a: Engine, b: Engine) -> bool:
    """Whether a P/D pair spans hosts (not both on the one host of a single-host engine)."""
    return not (len(a.place) == 1 and a.hosts == b.hosts)


def accept_hint(path: JsonPath) -> str:
    """The end of a code-loading finding's message: how to accept it by its path."""
    return f"to keep it, accept it with a reason: accept: {{{format_path(path)!r}: why}}"


def extra_flags(topo: Topology, engine: Engine) -> Iterator[tuple[JsonPath, ExtraFlag]]:
    """(path, flag) of each flag of an engine's extra_args as its parser reads it, at the path
    where the user wrote it (`defaults.extra_args` come first in the merged list)."""
    inherited = len(topo.raw.get("defaults", {}).get("extra_args", []))
    for flag in read_extra_args(engine.engine, engine.extra_args):
        i = flag.index
        path: JsonPath = (
            ("defaults", "extra_args", i)
            if i < inherited
            else ("engines", engine.name, "extra_args", i - inherited)
        )
        yield path, flag
