"""The stages of `deploys/site.py`, in order, and which of them the current run includes.

A stage's preflight can leave out what a later stage of the same run will fix (a runtime the
runtime stage installs); run alone, each deploy checks everything.

    >>> requested_stages("weights, engines")
    ['weights', 'engines']
"""

from __future__ import annotations

STAGES = ("preflight", "provision", "runtime", "weights", "caches", "engines", "monitoring")

# Set by deploys/site.py for the run; None when a stage's deploy file runs on its own.
_SITE_STAGES: list[str] | None = None


def requested_stages(value: object) -> list[str]:
    """The stages a `--data stages=a,b` value names (all when empty); ValueError on unknown."""
    text = str(value or ",".join(STAGES))
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; stages are: {', '.join(STAGES)}")
    return wanted


def set_site_stages(stages: list[str]) -> None:
    global _SITE_STAGES
    _SITE_STAGES = list(stages)


def in_site_run(stage: str) -> bool:
    """Whether `stage` is part of this deploy (only ever true under deploys/site.py): for the
    preflight, the runtime stage will install what is missing; for the runtime stage, the
    provision stage installs the driver its CUDA check is against."""
    return _SITE_STAGES is not None and stage in _SITE_STAGES
