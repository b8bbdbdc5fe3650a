"""The rule registry: a rule is a small function registered with an id, a severity, a summary
(what it checks) and why it exists; it yields findings as (json path, message) pairs. The
modules of hgxserve.topology.rules register the rules, one module per rule family, and
hgxserve.topology.rules runs them.

Most rules look at one engine, or at the proxy, at a time: `engine_rule` and `proxy_rule`
register those, handing the function each engine (of one kind, when given) or the proxy (of the
kinds given) in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import wraps

from hgxserve.topology.model import Engine, Proxy, Topology
from hgxserve.topology.problems import JsonPath, Severity

Finding = tuple[JsonPath, str]
RuleFunc = Callable[[Topology], Iterator[Finding]]
EngineCheck = Callable[[Topology, Engine], Iterator[Finding]]
ProxyCheck = Callable[[Topology, Proxy], Iterator[Finding]]

# the proxy kinds that are routers of an engine project, not hgxserve's own proxy
ROUTERS = ("vllm-router", "sglang-router")


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity
    summary: str  # what the rule checks (`validate --list-rules`)
    why: str  # what goes wrong without it (the rule table of docs/topology.md)
    check: RuleFunc


RULES: dict[str, Rule] = {}


def rule(
    rule_id: str, severity: Severity, summary: str, *, why: str
) -> Callable[[RuleFunc], RuleFunc]:
    """Register a rule.

    >>> @rule(
    ...     "gpu-overlap", "error", "No GPU is used by two engines on one host.",
    ...     why="two engines on one GPU OOM 10-20 minutes into start-up",
    ... )
    ... def gpu_overlap(topo): ...  # doctest: +SKIP
    """

    def register(func: RuleFunc) -> RuleFunc:
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id} registered twice")
        RULES[rule_id] = Rule(rule_id, severity, summary, why, func)
        return func

    return register


def engine_rule(  # noqa: PLR0913 - id, severity, summary, then why and the engine filters
    rule_id: str,
    severity: Severity,
    summary: str,
    *,
    why: str,
    engine: str | None = None,
    when: Callable[[Topology, Engine], bool] | None = None,
) -> Callable[[EngineCheck], RuleFunc]:
    """Register a rule that looks at each engine in turn: every engine, or only those of the
    `engine` kind (vllm, sglang), and of those only where `when(topo, engine)` holds."""

    def register(func: EngineCheck) -> RuleFunc:
        @wraps(func)
        def check(topo: Topology) -> Iterator[Finding]:
            for each in topo.engines.values():
                if (engine is None or each.engine == engine) and (when is None or when(topo, each)):
                    yield from func(topo, each)

        return rule(rule_id, severity, summary, why=why)(check)

    return register


def proxy_rule(
    rule_id: str,
    severity: Severity,
    summary: str,
    *,
    why: str,
    kinds: Collection[str] | None = None,
) -> Callable[[ProxyCheck], RuleFunc]:
    """Register a rule on the proxy: it runs where the topology has one (of `kinds`, if given)."""

    def register(func: ProxyCheck) -> RuleFunc:
        @wraps(func)
        def check(topo: Topology) -> Iterator[Finding]:
            proxy = topo.proxy
            if proxy is not None and (kinds is None or proxy.kind in kinds):
                yield from func(topo, proxy)

        return rule(rule_id, severity, summary, why=why)(check)

    return register


def data_parallel(topo: Topology, engine: Engine) -> bool:
    """`when=` for rules about data parallel engines (DP 2 or more)."""
    return engine.dp >= 2


def sparse_attention(topo: Topology, engine: Engine) -> bool:
    """`when=` for rules about DSA models (DeepSeek sparse attention)."""
    return topo.model.architecture.attention == "dsa"
