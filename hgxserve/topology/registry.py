"""The rule registry: a rule is a small function registered with an id and a severity; it yields
findings as (json path, message) pairs. hgxserve.topology.checks registers the rules;
hgxserve.topology.rules runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hgxserve.topology.model import Topology
from hgxserve.topology.problems import JsonPath, Severity

Finding = tuple[JsonPath, str]
RuleFunc = Callable[[Topology], Iterator[Finding]]


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity
    summary: str
    check: RuleFunc


RULES: dict[str, Rule] = {}


def rule(rule_id: str, severity: Severity, summary: str) -> Callable[[RuleFunc], RuleFunc]:
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
