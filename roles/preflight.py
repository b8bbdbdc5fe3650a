"""Refuse to touch a host whose hardware or state does not match the topology.

Reads the host facts (GPUs, NVSwitch, Fabric Manager, RDMA, peermem, shm, memlock, disk) and
raises one DeployError listing every mismatch as `HOST: FACT: expected X, found Y`, before any
operation runs.

Example:
    from roles.preflight import HostExpectation, preflight
    preflight(expect=HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8))
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import DeployError, deploy

from hgxserve.facts import HOST_FACTS
from hgxserve.facts.preflight import HostExpectation, preflight_problems

__all__ = ["HostExpectation", "gather_facts", "preflight", "preflight_problems"]


def gather_facts(model_path: str | None = None) -> dict[str, Any]:
    """Read every HOST_FACTS fact from the current host (the disk fact for `model_path`).

    Example:
        facts = gather_facts("/models/DeepSeek-V3.2")
    """
    facts: dict[str, Any] = {}
    for name, fact in HOST_FACTS.items():
        if name == "disk":
            if model_path:
                facts[name] = host.get_fact(fact, path=model_path)
            continue
        facts[name] = host.get_fact(fact)
    return facts


@deploy("Check the host against the topology")
def preflight(expect: HostExpectation, after_provision: bool = True) -> None:
    """Raise DeployError naming host, fact, expected and found for every mismatch.

    + expect: what the topology requires of this host
    + after_provision: also require what provisioning sets (shm, memlock, peermem, FM)

    Example:
        preflight(expect=HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8))
    """
    facts = gather_facts(expect.model_path)
    problems = preflight_problems(facts, expect, after_provision=after_provision)
    if problems:
        raise DeployError(
            f"preflight failed on {expect.host} ({len(problems)} problem"
            f"{'s' if len(problems) != 1 else ''}):\n  " + "\n  ".join(problems)
        )
