"""The stages of `deploys/site.py`, in order, and which of them the current run includes.

A stage's preflight can leave out what a later stage of the same run will fix (a runtime the
runtime stage installs); run alone, each deploy checks everything. deploys/site.py records the
stages it runs, per host and per pyinfra run (`hgxserve.base.runstate`), before it includes them.
"""

from __future__ import annotations

from pyinfra.api.host import Host

from hgxserve.base.runstate import per_run, recorded

STAGES = ("preflight", "provision", "runtime", "weights", "caches", "engines", "monitoring")


def _key(host: Host) -> tuple[str, str]:
    return ("site-stages", host.name)


def record_site_stages(host: Host, stages: tuple[str, ...]) -> tuple[str, ...]:
    """Note, for this run, that deploys/site.py runs `stages` on `host` (in STAGES order)."""
    ordered = tuple(stage for stage in STAGES if stage in stages)
    return per_run(host.state, _key(host), lambda: ordered)


def in_site_run(host: Host, stage: str) -> bool:
    """Whether `stage` is part of this deploy (only ever true under deploys/site.py): for the
    preflight, the runtime stage will install what is missing; for the runtime stage, the
    provision stage installs the driver its CUDA check is against."""
    stages: tuple[str, ...] | None = recorded(host.state, _key(host))
    return stages is not None and stage in stages
