"""Refuse to touch a host whose hardware or state does not match the topology.

Reads the host facts (GPUs, NVSwitch, Fabric Manager, RDMA, peermem, shm, memlock, disk) and
raises one DeployError listing every mismatch as `HOST: FACT: expected X, found Y`, before any
operation runs.

Example:
    from roles.preflight import HostExpectation, preflight
    preflight(plan=preflight_plan(host))  # hgxserve.deploy.plans, as deploys/preflight.py does
    preflight(expect=HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8))
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import DeployError, deploy

from hgxserve.deploy.plans import PreflightPlan, plan_or_fields
from hgxserve.facts import HOST_FACTS
from hgxserve.facts.preflight import HostExpectation, preflight_problems
from hgxserve.facts.runtime import ContainerImage, DriverCuda, VenvRuntimeState
from hgxserve.runtime.checks import image_problems, runtime_problems

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
def preflight(*, plan: PreflightPlan | None = None, **fields: Any) -> None:
    """Raise DeployError naming host, fact, expected and found for every mismatch.

    + plan: the preflight's plan (hgxserve.deploy.plans.PreflightPlan), or its fields as
      keywords instead:
      expect: what the topology requires of this host;
      after_provision: also require what provisioning sets (shm, memlock, peermem, FM);
      runtimes: engine venvs to check (engine version, extras that must import, UCX, CUDA);
      runtime_installs: the runtime stage runs later in this deploy (missing parts are fine);
      planned_driver: the driver version a later provision stage installs (for the CUDA check);
      images: (image, tool) container runtimes that must be loaded

    Example:
        preflight(expect=HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8))
    """
    plan = plan_or_fields(plan, PreflightPlan, fields)
    expect, runtimes, images = plan.expect, plan.runtimes, plan.images
    facts = gather_facts(expect.model_path)
    problems = preflight_problems(facts, expect, after_provision=plan.after_provision)
    if runtimes:
        states = {
            spec.venv: host.get_fact(
                VenvRuntimeState, venv=spec.venv, dist=spec.dist, imports=spec.imports
            )
            for spec in runtimes
        }
        problems += runtime_problems(
            expect.host,
            list(runtimes),
            states,
            host.get_fact(DriverCuda),
            will_install=plan.runtime_installs,
            planned_driver=plan.planned_driver,
        )
    if images and not plan.runtime_installs:
        image_states = {
            image: host.get_fact(ContainerImage, tool=f"/usr/bin/{tool}", image=image)
            for image, tool in images
        }
        problems += image_problems(expect.host, list(images), image_states)
    if problems:
        raise DeployError(
            f"preflight failed on {expect.host} ({len(problems)} problem"
            f"{'s' if len(problems) != 1 else ''}):\n  " + "\n  ".join(problems)
        )
