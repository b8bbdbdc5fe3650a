"""Semantic rules: what the schema cannot say (GPU overlap, port clashes, P/D agreement...).

One module per rule family, named by what its rules check; each declares the ids it holds in
`FAMILY` (an id, or a prefix ending in "-"), and an id matches the family of exactly one module:

    network     address-*, port-*, reachable, firewall-config, exposed-listener
    gpu         host-known, gpu-*, multi-host-gpu-kind
    monitoring  monitoring-*
    pd          pd-*, side-channel-*
    proxy       proxy-*, kv-events-*
    vllm        vllm-*, and the vLLM-only attention-backend, dcp-sparse, tokenizer-mode,
                dp-nccl-sync, async-scheduling-dp, mtp-pd-version, ray-single-node
    sglang      sglang-*
    engine      eplb-*, heads-per-rank, max-num-seqs-unset, served-name, extra-args-typed,
                extra-args-known
    fit         fit-*, model-config
    code        remote-code-*, args-load-code, package-known
    env         env-*
    files       file-source, file-source-place, engine-path-provided
    secrets     secret-env, credential-names, engine-api-key
    gate        gate, gate-*, warmup-*
    kernels     kernel-*
    runtime     engine-runtime, runtime-*

`RULE_MODULES` lists them; importing this package imports each, which registers its rules in
hgxserve.topology.registry (`common` holds what several of them share and registers none).
`rule_problems` runs every rule and turns its findings into positioned Problems.
"""

from __future__ import annotations

from hgxserve.topology.loader import Document
from hgxserve.topology.model import Topology
from hgxserve.topology.problems import Problem
from hgxserve.topology.registry import RULES, Finding, Rule, rule
from hgxserve.topology.rules import (
    code,
    engine,
    env,
    files,
    fit,
    gate,
    gpu,
    kernels,
    monitoring,
    network,
    pd,
    proxy,
    runtime,
    secrets,
    sglang,
    vllm,
)

__all__ = ["RULES", "RULE_MODULES", "Finding", "Rule", "rule", "rule_problems"]

# every module of this package that registers rules (tests/topology/test_rules_modules.py
# checks that no module is left out and that each registers one at least)
RULE_MODULES = (
    network,
    gpu,
    monitoring,
    pd,
    proxy,
    vllm,
    sglang,
    engine,
    fit,
    code,
    env,
    files,
    secrets,
    gate,
    kernels,
    runtime,
)


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
