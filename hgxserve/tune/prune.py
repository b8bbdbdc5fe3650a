"""Pruning before any deploy: what `hgxserve validate` and `hgxserve plan` say of a candidate.

A candidate is pruned when `validate` finds an error (its rules include the memory / KV-cache
fit estimate's errors, `fit-weights` and `fit-context`) or when the fit estimate itself says an
engine does not fit (`no-fit`, docs/fit.md) or cannot be computed (a broken model config). Every
reason is kept, as `validate` prints it, with the rule that found it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hgxserve.topology import Topology, check_topology


@dataclass
class Checked:
    file: Path
    topology: Topology | None
    reasons: list[str] = field(default_factory=list)  # empty: a survivor
    notes: list[str] = field(default_factory=list)  # warnings and `tight` fits, not pruned

    @property
    def pruned(self) -> bool:
        return bool(self.reasons)


def _fit_reasons(topo: Topology, reported: set[str]) -> tuple[list[str], list[str]]:
    from hgxserve.topology import fit

    try:
        _, fits = fit.topology_fit(topo)
    except fit.ConfigError as exc:
        return [f"fit estimate: {exc}"], []
    reasons, notes = [], []
    for name, est in fits.items():
        line = (
            f"fit estimate: {name}: {est.status} (weights ~{fit.gib(est.weights)} GiB of a "
            f"{fit.gib(est.budget)} GiB budget per GPU, ~{est.kv_tokens} KV tokens per rank)"
        )
        if est.status == "no-fit" and name not in reported:
            reasons.append(line)
        elif est.status in ("tight", "seed-oom"):
            notes.append(line)
    return reasons, notes


def check(path: Path) -> Checked:
    """One candidate through validate and the fit estimate."""
    result = check_topology(path)
    reasons = [f"{p.text()} (rule {p.rule})" for p in result.errors]
    notes = [p.text() for p in result.warnings]
    if result.topology is None:
        return Checked(path, None, reasons or [f"{path}: cannot be read"], notes)
    # engines a fit rule already named (its message starts with the engine's name)
    reported = {
        name
        for p in result.errors
        if p.rule.startswith("fit-")
        for name in result.topology.engines
        if p.message.startswith(f"{name}:")
    }
    fit_reasons, fit_notes = _fit_reasons(result.topology, reported)
    return Checked(path, result.topology, reasons + fit_reasons, notes + fit_notes)
