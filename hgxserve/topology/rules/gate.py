"""Rules on the release gate and the warm-up: gate, gate-* and warmup-*.

The gate's regex compiles, its host exists and its probes can run; cross-host NIXL P/D over TCP
only is flagged before the gate's RDMA check fails it; each warm-up shape fits the engines'
max_model_len.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from hgxserve.topology.model import Topology
from hgxserve.topology.ports import setting_path, warmup_targets
from hgxserve.topology.registry import Finding, rule
from hgxserve.topology.rules.common import cross_host, pd_pairs

FAMILY = ("gate", "gate-", "warmup-")


@rule(
    "gate",
    "error",
    "The gate's regex compiles, its host exists, its probes can run.",
    why="a gate whose probe cannot run fails every release for a reason unrelated to serving",
)
def gate_settings(topo: Topology) -> Iterator[Finding]:
    gate = topo.gate
    if gate.expect_regex is not None:
        try:
            re.compile(gate.expect_regex)
        except re.error as exc:
            yield ("gate", "expect_regex"), f"not a valid regular expression: {exc}"
    if gate.from_host is not None and gate.from_host not in topo.hosts:
        known = ", ".join(topo.hosts)
        yield (
            ("gate", "from"),
            f"unknown host '{gate.from_host}'; define it under hosts (hosts are: {known})",
        )
    if gate.from_host is not None and topo.proxy is None:
        yield ("gate", "from"), "the gate runs through the proxy: this topology has none"
    if gate.bench is not None:
        names = [s.get("name") for s in (topo.raw.get("bench") or {}).get("scenarios") or []]
        if topo.proxy is None:
            yield ("gate", "bench"), "the bench runs through the proxy: this topology has none"
        elif gate.bench.scenario not in names:
            yield (
                ("gate", "bench", "scenario"),
                f"no scenario '{gate.bench.scenario}' in this topology's bench: section "
                f"(scenarios: {', '.join(map(str, names)) or 'none'}); the release's SLA lives "
                "in the topology itself, not in a bench file beside it",
            )
    for key, arg in (("reasoning", "reasoning_parser"), ("tool_call", "tool_call_parser")):
        if getattr(gate, key) == "on" and not any(e.args.get(arg) for e in topo.engines.values()):
            yield (
                ("gate", key),
                f"the {key} probe is on but no engine sets args.{arg}: it would always fail",
            )


@rule(
    "gate-rdma-tcp",
    "warning",
    "Cross-host NIXL P/D whose kv.ucx_tls names no RDMA transport fails the gate's RDMA check.",
    why=(
        "seed 003 §11.3: KV over TCP looks healthy; the gate's RDMA check fails every "
        "release instead"
    ),
)
def gate_rdma_over_tcp(topo: Topology) -> Iterator[Finding]:
    if topo.gate.rdma == "off":
        return
    reported: set[str] = set()
    for _index, p, d in pd_pairs(topo):
        if not cross_host(p, d):
            continue
        for engine in (p, d):
            kv = engine.kv
            if engine.name in reported or kv is None or not kv.ucx_tcp_only:
                continue
            reported.add(engine.name)
            yield (
                setting_path(topo, engine.name, "kv", "ucx_tls"),
                f"UCX_TLS={','.join(kv.ucx_tls or ())} names no RDMA transport: KV between "
                f"{p.name} ({', '.join(p.hosts)}) and {d.name} ({', '.join(d.hosts)}) can only "
                "go over TCP, and the gate's RDMA check (gate.rdma: auto) fails every release; "
                "add an RDMA transport (e.g. rc) or, where the hosts have no RDMA NIC, set "
                "gate.rdma: off (the deploy then says the KV went over TCP)",
            )


@rule(
    "warmup-max-model-len",
    "error",
    "Warm-up input + output fits the engines' max_model_len.",
    why="a warm-up longer than the context is rejected and warms nothing",
)
def warmup_max_model_len(topo: Topology) -> Iterator[Finding]:
    for index, shape in enumerate(topo.warmup):
        names = warmup_targets(topo, shape)
        total = shape.input + shape.output
        shortest = topo.shortest_max_model_len(names)
        if shortest is None:
            continue
        limit, name = shortest
        if total > limit:
            yield (
                ("warmup", index),
                f"input {shape.input} + output {shape.output} = {total} tokens exceeds "
                f"max_model_len {limit} of {name}; the warm-up request would be rejected: "
                f"shorten the shape to at most {limit} tokens or raise max_model_len",
            )
