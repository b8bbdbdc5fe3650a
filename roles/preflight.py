"""Refuse to touch a host whose hardware or state does not match the topology.

Reads the host facts (GPUs, NVSwitch, Fabric Manager, RDMA, peermem, shm, memlock, disk, CPUs
and RAM) and raises one DeployError listing every mismatch as `HOST: FACT: expected X, found Y`,
before any operation runs. What does not refuse a host (CPUs, RAM or /dev/shm below seed 003
§2.1's figures, a disk check without a model size) is logged as a warning.

Example:
    from roles.preflight import HostExpectation, preflight
    preflight(plan=preflight_plan(host))  # hgxserve.deploy.plans, as deploys/preflight.py does
    preflight(expect=HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8))
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pyinfra import host, logger
from pyinfra.api import DeployError, deploy

from hgxserve.deploy.plans import PreflightPlan, plan_or_fields
from hgxserve.facts import HOST_FACTS
from hgxserve.facts.preflight import HostExpectation, preflight_problems, preflight_warnings
from hgxserve.facts.runtime import (
    ContainerImage,
    ContainerImageCheck,
    DriverCuda,
    HostPython,
    VenvRuntimeState,
)
from hgxserve.facts.weights import ManifestSize
from hgxserve.runtime.agent_build import python_problem
from hgxserve.runtime.checks import image_problems, runtime_problems
from hgxserve.runtime.image_check import image_check_problems as judge_image

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


def sized_from_host(expect: HostExpectation) -> HostExpectation:
    """`expect` with the model's size from the manifest already on the host, when neither the
    topology's model.size nor a published manifest (read on the controller) gave one."""
    if expect.model_size_bytes or not expect.model_copied or not expect.model_path:
        return expect
    name = expect.model_manifest or "hgxserve-manifest.json"
    found = host.get_fact(ManifestSize, dest=expect.model_path, manifest=name)
    if found.get("bytes"):
        return replace(
            expect,
            model_size_bytes=found["bytes"],
            model_size_from=f"the manifest on the host, {found['file']}",
        )
    where = f"none on the host at {expect.model_path.rstrip('/')}/{name}"
    why = f"{expect.model_size_from}; {where}" if expect.model_size_from else where
    return replace(expect, model_size_from=why)


def image_check_problems(
    expect: HostExpectation, image_states: dict[str, dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of each loaded engine image that needs the host's HCAs or kernel
    packages, run once as the engine runs (hgxserve.runtime.image_check; `--rm --pull=never`,
    nothing changes): one line for missing HCAs, one for kernels that do not import."""
    problems: list[str] = []
    warnings: list[str] = []
    for check in expect.image_checks:
        state = image_states.get(check.image) or {}
        if state.get("digest") != check.image.rpartition("@")[2]:
            continue  # not loaded: image_problems says so
        devices = expect.rdma_devices if check.fabric else ()
        output = host.get_fact(
            ContainerImageCheck,
            tool=f"/usr/bin/{check.tool}",
            image=check.image,
            devices=devices,
            modules=check.modules,
            gpu=check.gpu,
        )
        found, advised = judge_image(expect.host, check, devices, output)
        problems += found
        warnings += advised
    return problems, warnings


def python_problems(name: str) -> list[str]:
    """The host's python3 against the agent's (3.10 to 3.13, its venv and wheels are built for
    it): one line naming the version when outside, as the other facts' lines read."""
    problem = python_problem(host.get_fact(HostPython).get("version"))
    return [f"{name}: python3: {problem}"] if problem else []


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
      images: (image, tool) container runtimes that must be loaded (and, for those whose
      engines need the host's HCAs or kernel packages, that see and import them:
      expect.image_checks)

    Example:
        preflight(expect=HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8))
    """
    plan = plan_or_fields(plan, PreflightPlan, fields)
    expect, runtimes, images = sized_from_host(plan.expect), plan.runtimes, plan.images
    facts = gather_facts(expect.model_path)
    for line in preflight_warnings(facts, expect):
        logger.warning(f"{host.print_prefix}preflight: {line}")
    problems = preflight_problems(facts, expect, after_provision=plan.after_provision)
    problems += python_problems(expect.host)
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
        found, advised = image_check_problems(expect, image_states)
        problems += found
        for line in advised:
            logger.warning(f"{host.print_prefix}preflight: {line}")
    if problems:
        raise DeployError(
            f"preflight failed on {expect.host} ({len(problems)} problem"
            f"{'s' if len(problems) != 1 else ''}):\n  " + "\n  ".join(problems)
        )
