"""Semantic rules: what the schema cannot say (GPU overlap, port clashes, P/D agreement...).

The rules live in hgxserve.topology.checks, engine_rules, render_rules, address_rules,
kernels and load_rules,
registered in hgxserve.topology.registry; this module runs them and turns their findings into
positioned Problems.
"""

from __future__ import annotations

# importing the rule modules registers their rules
from hgxserve.topology import (  # noqa: F401
    address_rules,
    checks,
    engine_rules,
    kernels,
    load_rules,
    render_rules,
)
from hgxserve.topology.loader import Document
from hgxserve.topology.model import Topology
from hgxserve.topology.problems import Problem
from hgxserve.topology.registry import RULES, Finding, Rule, rule

__all__ = ["RULES", "Finding", "Rule", "rule", "rule_problems"]


def rule_problems(topo: Topology, doc: Document) -> list[Problem]:
    """Run every registered rule over a schema-valid topology."""
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
