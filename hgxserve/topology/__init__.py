"""Topology: load, validate (schema + rules) and model one YAML serving topology.

>>> from hgxserve.topology import load_topology
>>> topo = load_topology("topologies/h20-v4flash-4p4d.yml")  # doctest: +SKIP
>>> [e.name for e in topo.engines_on("h20-a")]  # doctest: +SKIP
['prefill-0', 'decode-0']
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hgxserve.topology.loader import Document, load_document
from hgxserve.topology.model import (
    Engine,
    Host,
    KvTransfer,
    Model,
    Proxy,
    Runtime,
    SecretRef,
    Topology,
    build_topology,
)
from hgxserve.topology.problems import Problem, TopologyError, format_path, sort_problems

__all__ = [
    "CheckResult",
    "Engine",
    "Host",
    "KvTransfer",
    "Model",
    "Problem",
    "Proxy",
    "Runtime",
    "SecretRef",
    "Topology",
    "TopologyError",
    "check_topology",
    "load_topology",
]


@dataclass
class CheckResult:
    """Outcome of checking one file: the topology (when schema-valid) and every problem."""

    file: str
    topology: Topology | None
    problems: list[Problem]
    unreadable: bool = False

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.is_error]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if not p.is_error]


def check_topology(path: str | Path) -> CheckResult:
    """Load and check a topology file; never raises for problems in the file itself."""
    from hgxserve.topology.rules import rule_problems
    from hgxserve.topology.schema import schema_problems

    try:
        doc: Document = load_document(path)
    except TopologyError as exc:
        return CheckResult(str(path), None, sort_problems(exc.problems), exc.unreadable)
    # a value with a control character is reported once, by the loader, not again per pattern
    refused = {p.path for p in doc.problems if p.rule == "control-character"}
    problems = doc.problems + [p for p in schema_problems(doc) if p.path not in refused]
    if problems:
        return CheckResult(doc.file, None, sort_problems(problems))
    topo = build_topology(doc.data, doc.file)
    problems = _accepted(rule_problems(topo, doc), doc)
    return CheckResult(doc.file, topo, sort_problems(problems))


def _accepted(problems: list[Problem], doc: Document) -> list[Problem]:
    """Drop the warnings of rules the topology accepts (`accept: {rule: why}`) and the
    findings of the rules of ITEM_ACCEPTABLE it accepts one by one (`accept: {"$.path": why}`,
    hgxserve.topology.rules.common); an accepted id that is no warning rule, or a path that no
    such finding has, is an error itself."""
    from hgxserve.topology.rules import RULES
    from hgxserve.topology.rules.common import ITEM_ACCEPTABLE

    accept = doc.data.get("accept") or {}
    items = {key for key in accept if key.startswith("$")}
    lifted = {format_path(p.path) for p in problems if p.rule in ITEM_ACCEPTABLE} & items
    kept = [
        p
        for p in problems
        if not (p.rule in ITEM_ACCEPTABLE and format_path(p.path) in lifted)
        and (p.is_error or p.rule not in accept)
    ]
    for key in sorted(items - lifted):
        why = (
            "no finding of a rule accepted by its path has this path "
            f"({', '.join(ITEM_ACCEPTABLE)}); copy the path from validate's message"
        )
        kept.append(doc.problem(("accept", key), why, rule="accept", key=True))
    for rule_id in sorted(set(accept) - items):
        known = RULES.get(rule_id)
        if known is None:
            why = "no rule has this id (hgxserve validate --list-rules)"
        elif known.severity != "warning":
            why = f"{rule_id} finds errors, and errors cannot be accepted"
        else:
            continue
        kept.append(doc.problem(("accept", rule_id), why, rule="accept", key=True))
    return kept


def load_topology(path: str | Path) -> Topology:
    """Load a topology that must be valid (warnings allowed); raise TopologyError otherwise."""
    result = check_topology(path)
    if result.errors or result.topology is None:
        raise TopologyError(result.errors or result.problems, unreadable=result.unreadable)
    return result.topology
