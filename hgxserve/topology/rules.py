"""Semantic rules: what the schema cannot say (GPU overlap, port clashes, P/D agreement...).

Each rule is a small function registered with an id and a severity; it yields findings as
(json path, message) pairs and the framework turns them into positioned Problems.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hgxserve.topology.loader import Document
from hgxserve.topology.model import Topology
from hgxserve.topology.problems import JsonPath, Problem

Finding = tuple[JsonPath, str]
RuleFunc = Callable[[Topology], Iterator[Finding]]


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str  # error | warning
    summary: str
    check: RuleFunc


RULES: dict[str, Rule] = {}


def rule(rule_id: str, severity: str, summary: str) -> Callable[[RuleFunc], RuleFunc]:
    """Register a rule.

    >>> @rule("gpu-overlap", "error", "No GPU is used by two engines on one host.")
    ... def gpu_overlap(topo): ...  # doctest: +SKIP
    """

    def register(func: RuleFunc) -> RuleFunc:
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id} registered twice")
        RULES[rule_id] = Rule(rule_id, severity, summary, func)
        return func

    return register


def rule_problems(topo: Topology, doc: Document) -> list[Problem]:
    """Run every registered rule over a schema-valid topology."""
    from hgxserve.topology import checks  # noqa: F401  (registers the rules)

    problems = []
    for r in RULES.values():
        seen: set[Finding] = set()
        for path, message in r.check(topo):
            # a setting in `defaults` shared by several engines is reported once
            if (path, message) in seen:
                continue
            seen.add((path, message))
            problems.append(doc.problem(path, message, rule=r.id, severity=r.severity))
    return problems
