"""The tune SPEC: a YAML file checked like a topology (every error `file:line:col: $.path: msg`).

    base: demo-pd.yml                 # a topology (relative to this file); its bench scenarios
    candidates: [a.yml, b.yml]        # topology files to compare ...
    matrix:                           # ... or a matrix over the base, per role
      prefill: {tp: [2, 4], count: [1, 2]}
      decode: {tp: [4], max_num_seqs: [8, 16]}
    scenarios: [pd-long]              # which of the base's bench scenarios (default: all)
    sla: {ttft_s: 1, tpot_ms: 15}     # replaces every scenario's SLA (optional)
    inventory: ../../inventory/testhosts.py
    leave: best                       # or baseline
    baseline: demo-baseline.yml       # what `leave: baseline` (or no winner) deploys; default base
    deploy: {stages: [runtime, weights, engines], data: {health_timeout: 900}}

Every number is bounded; a matrix expands to at most MAX_CANDIDATES candidates. `deploy.data`
sets only the `--data` keys hgxserve/deploy/data.py marks tunable (`hgxserve deploy-data`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hgxserve.base.defaults import topology_schema
from hgxserve.topology import TopologyError
from hgxserve.topology.loader import Document, load_document
from hgxserve.topology.problems import Problem, sort_problems

# More candidates than this is a sweep of days on real hosts (each cold start 4-25 min): split it.
MAX_CANDIDATES = 64
MATRIX_ROLES = ("prefill", "decode", "combined")
# The deploy stages a candidate's release runs by default: the engine runtime and weights a
# candidate may change, then the release itself (stage, switch, gate, confirm or roll back).
DEFAULT_STAGES = ("runtime", "weights", "engines")
STAGES = ("preflight", "provision", "runtime", "weights", "caches", "engines", "monitoring")


def _values(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "minItems": 1, "maxItems": 16, "uniqueItems": True, "items": item}


def _int(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


_ROLE_AXES = {
    "type": "object",
    "additionalProperties": False,
    "minProperties": 1,
    "properties": {
        "tp": _values(_int(1, 64)),
        "dp": _values(_int(1, 64)),
        "ep": _values({"type": "boolean"}),
        "count": _values(_int(1, 64)),
        "max_num_seqs": _values(_int(1, 65536)),
        "max_num_batched_tokens": _values(_int(1, 10_000_000)),
        "engine": _values({"type": "string", "enum": ["vllm", "sglang"]}),
    },
}
_FILE = {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^[^\\x00]+$"}
SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["base"],
    "oneOf": [{"required": ["candidates"]}, {"required": ["matrix"]}],
    "properties": {
        "base": _FILE,
        "candidates": {"type": "array", "minItems": 1, "maxItems": MAX_CANDIDATES, "items": _FILE},
        "matrix": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {role: _ROLE_AXES for role in MATRIX_ROLES},
        },
        "scenarios": {
            "type": "array",
            "minItems": 1,
            "maxItems": 64,
            "uniqueItems": True,
            "items": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,62}$"},
        },
        "sla": {"$ref": "#/$defs/bench_sla"},
        "inventory": _FILE,
        "leave": {"type": "string", "enum": ["best", "baseline"], "default": "best"},
        "baseline": _FILE,
        "deploy": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "stages": {
                    "type": "array",
                    "minItems": 1,
                    "uniqueItems": True,
                    "items": {"type": "string", "enum": list(STAGES)},
                },
                "data": {
                    "type": "object",
                    "maxProperties": 64,
                    "propertyNames": {"pattern": "^[a-z][a-z0-9_]{0,63}$"},
                    "additionalProperties": {
                        "type": ["string", "integer", "number", "boolean"],
                        "maxLength": 4096,
                    },
                },
            },
        },
    },
}


@functools.cache
def _validator() -> Any:
    from hgxserve.topology.schema import _StrictValidator

    return _StrictValidator({**SPEC_SCHEMA, "$defs": topology_schema()["$defs"]})


@dataclass(frozen=True)
class TuneSpec:
    file: str
    digest: str  # sha256 of the SPEC's bytes: a resumed tune must run the same SPEC
    base: Path
    candidates: tuple[Path, ...] = ()
    matrix: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    scenarios: tuple[str, ...] = ()
    sla: dict[str, Any] | None = None
    inventory: Path | None = None
    leave: str = "best"
    baseline: Path | None = None
    stages: tuple[str, ...] = DEFAULT_STAGES
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline_file(self) -> Path:
        return self.baseline or self.base


def _relative(spec_file: Path, value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else (spec_file.parent / path)


def _file_problems(doc: Document, spec_file: Path) -> list[Problem]:
    """Files the SPEC names must exist (relative to the SPEC file)."""
    data = doc.data
    named: list[tuple[tuple[Any, ...], str]] = [
        ((key,), data[key]) for key in ("base", "inventory", "baseline") if key in data
    ]
    named += [(("candidates", i), c) for i, c in enumerate(data.get("candidates") or [])]
    return [
        doc.problem(path, f"{value}: no such file ({_relative(spec_file, value)})")
        for path, value in named
        if not _relative(spec_file, value).is_file()
    ]


def _matrix_problems(doc: Document) -> list[Problem]:
    """The expanded matrix stays small (MAX_CANDIDATES)."""
    total = 1
    for axes in (doc.data.get("matrix") or {}).values():
        for values in axes.values():
            total *= len(values)
    if total <= MAX_CANDIDATES:
        return []
    return [
        doc.problem(
            ("matrix",),
            f"expands to {total} candidates, more than {MAX_CANDIDATES} (each one a cold start "
            "of 4-25 min on real hosts): split it into several tunes",
        )
    ]


def _data_problems(doc: Document) -> list[Problem]:
    """`deploy.data` sets only the keys the deploy table marks tunable, with values that fit:
    a SPEC never sets what the inventory trusts (allow_env, pins, sources, hosts, topology)."""
    from hgxserve.deploy.data import untunable

    data = (doc.data.get("deploy") or {}).get("data") or {}
    out = []
    for name, value in data.items():
        why = untunable(name, value)
        if why is not None:
            out.append(doc.problem(("deploy", "data", name), why))
    return out


def load_spec(path: str | Path) -> TuneSpec:
    """The checked SPEC; TopologyError with every problem (and its position) otherwise."""
    from hgxserve.topology.schema import _problems_for

    doc = load_document(path)
    problems = list(doc.problems)
    if not problems:
        for error in _validator().iter_errors(doc.data):
            problems.extend(_problems_for(doc, error))
    spec_file = Path(path)
    if not problems:
        problems = _file_problems(doc, spec_file) + _matrix_problems(doc) + _data_problems(doc)
    if problems:
        raise TopologyError(sort_problems(problems))
    data = doc.data
    deploy = data.get("deploy") or {}
    return TuneSpec(
        file=str(spec_file),
        digest=hashlib.sha256(spec_file.read_bytes()).hexdigest(),
        base=_relative(spec_file, data["base"]),
        candidates=tuple(_relative(spec_file, c) for c in data.get("candidates") or ()),
        matrix=data.get("matrix") or {},
        scenarios=tuple(data.get("scenarios") or ()),
        sla=data.get("sla"),
        inventory=_relative(spec_file, data["inventory"]) if "inventory" in data else None,
        leave=data.get("leave", "best"),
        baseline=_relative(spec_file, data["baseline"]) if "baseline" in data else None,
        stages=tuple(deploy.get("stages") or DEFAULT_STAGES),
        data=dict(deploy.get("data") or {}),
    )
