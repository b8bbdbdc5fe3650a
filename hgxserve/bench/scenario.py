"""Bench scenarios: the topology's `bench:` section, or a bench file beside it.

A bench file `NAME.bench.yaml` next to `NAME.yml` holds the same `bench:` mapping; it is used when
the topology has no `bench:` of its own, so scenarios can change without changing the topology's
digest (and so without a new release). Both are checked like a topology: every error as
`file:line:col: $.path: message`.

>>> scenarios = [Scenario("short", 100, 16, concurrency=(1, 4))]
>>> [r.label for r in scenarios[0].load_points()]
['c1', 'c4']
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hgxserve.base.defaults import BENCH_DRAIN_TIMEOUT_S, BENCH_PERCENTILE, topology_schema
from hgxserve.base.errors import HgxserveError, UsageError
from hgxserve.topology import Topology, TopologyError, load_topology
from hgxserve.topology.loader import Document, load_document
from hgxserve.topology.problems import Problem, sort_problems

# .yaml, not .yml: tools that glob topologies/*.yml must not take it for a topology
BENCH_FILE_SUFFIX = ".bench.yaml"


# The statistics a latency target can apply to; "mean" is AIPerf's avg.
STATISTICS = ("mean", "p50", "p90", "p95", "p99")


@dataclass(frozen=True)
class Sla:
    """Targets one scenario must meet; None: not checked."""

    percentile: int = BENCH_PERCENTILE
    statistic: str | None = None  # mean | pNN; None: p<percentile>
    ttft_statistic: str | None = None
    tpot_statistic: str | None = None
    ttft_s: float | None = None
    tpot_ms: float | None = None
    prefill_tok_s_per_gpu: float | None = None
    output_tok_s_per_gpu: float | None = None
    error_rate: float | None = None

    @property
    def empty(self) -> bool:
        return all(
            v is None
            for v in (
                self.ttft_s,
                self.tpot_ms,
                self.prefill_tok_s_per_gpu,
                self.output_tok_s_per_gpu,
                self.error_rate,
            )
        )

    def statistic_for(self, figure: str) -> str:
        """The statistic of a latency figure ("ttft" or "tpot"): its own, else the SLA's,
        else p<percentile> (the older `percentile:` key)."""
        own = self.ttft_statistic if figure == "ttft" else self.tpot_statistic
        return own or self.statistic or f"p{self.percentile}"


def stat_key(name: str, statistic: str) -> str:
    """The client figure of a latency at a statistic: ("ttft_ms", "mean") -> "ttft_ms_avg"."""
    return f"{name}_{'avg' if statistic == 'mean' else statistic}"


@dataclass(frozen=True)
class Dataset:
    """Prompts from a file: `prompts` JSONL or `sharegpt` conversations (hgxserve.bench.dataset)."""

    path: Path
    format: str
    limit: int | None = None


@dataclass(frozen=True)
class LoadPoint:
    """One load level of a scenario: a concurrency, or a request rate capped by a concurrency."""

    concurrency: int
    rate: float | None = None

    @property
    def label(self) -> str:
        if self.rate is None:
            return f"c{self.concurrency}"
        return f"r{self.rate:g}-c{self.concurrency}"

    @property
    def x(self) -> float:
        """Where the point sits on a plot's x axis."""
        return float(self.concurrency if self.rate is None else self.rate)


@dataclass(frozen=True)
class Scenario:
    name: str
    input: int | None
    output: int | None
    api: str = "completions"
    concurrency: tuple[int, ...] = ()
    rate: tuple[float, ...] = ()
    max_concurrency: int | None = None
    requests: int | None = None
    duration_s: float | None = None
    warmup: int | None = None
    seeds: tuple[int, ...] = (0,)
    sla: Sla = field(default_factory=Sla)
    dataset: Dataset | None = None
    # a pool of `prefix_prompts` prefixes of `prefix_tokens` each, and multi-turn conversations
    # (`conversations` of `turns` each): shared-prefix load for prefix caches and KV routing
    prefix_prompts: int | None = None
    prefix_tokens: int | None = None
    conversations: int | None = None
    turns: int | None = None

    def load_points(self) -> list[LoadPoint]:
        if self.rate:
            cap = self.max_concurrency or 1
            return [LoadPoint(cap, r) for r in self.rate]
        return [LoadPoint(c) for c in self.concurrency]

    def warmup_for(self, point: LoadPoint) -> int:
        """Warm-up requests before a round: as written, else the round's concurrency."""
        return point.concurrency if self.warmup is None else self.warmup

    def requests_for(self, point: LoadPoint) -> int | None:
        """Measured requests of a round (None when the round is timed by duration_s)."""
        if self.duration_s is not None:
            return self.requests
        if self.requests is not None:
            return self.requests
        return max(16, 4 * point.concurrency)

    @property
    def x_axis(self) -> str:
        return "request rate (req/s)" if self.rate else "concurrency"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "input": self.input,
            "output": self.output,
            "api": self.api,
            "concurrency": list(self.concurrency),
            "rate": list(self.rate),
            "max_concurrency": self.max_concurrency,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "warmup": self.warmup,
            "seeds": list(self.seeds),
            "sla": self.sla.__dict__.copy(),
            "dataset": None,
            "shared_prefix": None,
            "conversations": None,
        }
        if self.prefix_prompts is not None:
            out["shared_prefix"] = {"prompts": self.prefix_prompts, "tokens": self.prefix_tokens}
        if self.conversations is not None:
            out["conversations"] = {"count": self.conversations, "turns": self.turns}
        out["sla"]["ttft_statistic"] = self.sla.statistic_for("ttft")
        out["sla"]["tpot_statistic"] = self.sla.statistic_for("tpot")
        if self.dataset is not None:
            out["dataset"] = {
                "path": str(self.dataset.path),
                "format": self.dataset.format,
                "limit": self.dataset.limit,
            }
        return out


@dataclass(frozen=True)
class BenchSpec:
    topology: Topology
    scenarios: tuple[Scenario, ...]
    drain_timeout_s: float
    source: str  # the file the scenarios came from

    def pick(self, names: list[str]) -> list[Scenario]:
        """The named scenarios (all when none are named); an unknown name is an error."""
        if not names:
            return list(self.scenarios)
        known = {s.name: s for s in self.scenarios}
        missing = [n for n in names if n not in known]
        if missing:
            raise UsageError(
                f"{self.source}: no scenario named {', '.join(missing)} "
                f"(scenarios: {', '.join(known)})"
            )
        return [known[n] for n in names]


def bench_file_for(topology_path: str | Path) -> Path:
    """`topologies/x.yml` -> `topologies/x.bench.yaml`."""
    path = Path(topology_path)
    return path.with_name(path.name.rsplit(".", 1)[0] + BENCH_FILE_SUFFIX)


@functools.cache
def _bench_file_validator() -> Any:
    from hgxserve.topology.schema import _StrictValidator

    schema = topology_schema()
    wrapper = {
        "type": "object",
        "additionalProperties": False,
        "required": ["bench"],
        "properties": {"bench": {"$ref": "#/$defs/bench"}},
        "$defs": schema["$defs"],
    }
    return _StrictValidator(wrapper)


def _sla(data: dict[str, Any] | None) -> Sla:
    data = data or {}
    return Sla(
        percentile=int(data.get("percentile", BENCH_PERCENTILE)),
        statistic=data.get("statistic"),
        ttft_statistic=data.get("ttft_statistic"),
        tpot_statistic=data.get("tpot_statistic"),
        ttft_s=data.get("ttft_s"),
        tpot_ms=data.get("tpot_ms"),
        prefill_tok_s_per_gpu=data.get("prefill_tok_s_per_gpu"),
        output_tok_s_per_gpu=data.get("output_tok_s_per_gpu"),
        error_rate=data.get("error_rate"),
    )


def _dataset(data: dict[str, Any] | None, base: Path) -> Dataset | None:
    if not data:
        return None
    return Dataset(base / data["path"], data["format"], data.get("limit"))


def _scenario(data: dict[str, Any], base: Path) -> Scenario:
    return Scenario(
        name=data["name"],
        input=int(data["input"]) if "input" in data else None,
        output=int(data["output"]) if "output" in data else None,
        api=data.get("api", "completions"),
        concurrency=tuple(int(c) for c in data.get("concurrency") or ()),
        rate=tuple(float(r) for r in data.get("rate") or ()),
        max_concurrency=data.get("max_concurrency"),
        requests=data.get("requests"),
        duration_s=data.get("duration_s"),
        warmup=data.get("warmup"),
        seeds=tuple(int(s) for s in data.get("seeds") or (0,)),
        sla=_sla(data.get("sla")),
        dataset=_dataset(data.get("dataset"), base),
        prefix_prompts=(data.get("shared_prefix") or {}).get("prompts"),
        prefix_tokens=(data.get("shared_prefix") or {}).get("tokens"),
        conversations=(data.get("conversations") or {}).get("count"),
        turns=(data.get("conversations") or {}).get("turns"),
    )


def _rule_problems(doc: Document, bench: dict[str, Any], base: tuple[Any, ...]) -> list[Problem]:
    """Cross-field rules the schema cannot say."""
    problems: list[Problem] = []
    names: set[str] = set()
    for idx, data in enumerate(bench.get("scenarios") or []):
        path = (*base, "scenarios", idx)
        if data["name"] in names:
            problems.append(doc.problem((*path, "name"), f"scenario {data['name']!r} repeats"))
        names.add(data["name"])
        top = max(data.get("concurrency") or [data.get("max_concurrency") or 1])
        warmup = data.get("warmup")
        if warmup is not None and warmup < top:
            problems.append(
                doc.problem(
                    (*path, "warmup"),
                    f"{warmup} warm-up requests are fewer than the concurrency {top}: every "
                    f"concurrent slot needs a warm request first (seed 003 §12.5); use >= {top}",
                )
            )
        if "requests" in data and "duration_s" in data:
            problems.append(
                doc.problem((*path, "duration_s"), "give requests or duration_s, not both")
            )
        problems += _shape_problems(doc, data, path)
        problems += _load_shape_problems(doc, data, path)
    return problems


def _load_shape_problems(
    doc: Document, data: dict[str, Any], path: tuple[Any, ...]
) -> list[Problem]:
    """Shared prefixes and conversations are synthetic load: not with a dataset; conversations
    are chat."""
    problems: list[Problem] = []
    for key in ("shared_prefix", "conversations"):
        if key in data and "dataset" in data:
            problems.append(
                doc.problem((*path, key), f"{key} shapes synthetic prompts: not with a dataset")
            )
    if "conversations" in data and data.get("api", "completions") != "chat":
        problems.append(
            doc.problem((*path, "conversations"), "multi-turn conversations need api: chat")
        )
    return problems


def _shape_problems(doc: Document, data: dict[str, Any], path: tuple[Any, ...]) -> list[Problem]:
    """Synthetic prompts need input and output; a dataset brings its own prompts; the SLA's
    statistic is given once."""
    problems: list[Problem] = []
    if "dataset" in data:
        if "input" in data:
            problems.append(
                doc.problem((*path, "input"), "a dataset brings its own prompts: drop input (ISL)")
            )
    else:
        for key in ("input", "output"):
            if key not in data:
                problems.append(
                    doc.problem(path, f"'{key}' is a required property (or give a dataset)")
                )
    sla = data.get("sla") or {}
    if "percentile" in sla and "statistic" in sla:
        problems.append(
            doc.problem(
                (*path, "sla", "statistic"),
                f"give statistic or percentile, not both (percentile {sla['percentile']} is "
                f"statistic p{sla['percentile']})",
            )
        )
    return problems


def load_bench(topology_path: str | Path) -> BenchSpec:
    """The validated topology and its scenarios; TopologyError (with positions) otherwise."""
    from hgxserve.topology.schema import _problems_for

    topo = load_topology(topology_path)
    if "bench" in topo.raw:
        doc = load_document(topology_path)
        bench, base, source = doc.data["bench"], ("bench",), doc.file
        problems = _rule_problems(doc, bench, base)
    else:
        path = bench_file_for(topology_path)
        if not path.exists():
            raise UsageError(
                f"{topology_path}: no bench scenarios: add a `bench:` section or write {path}"
            )
        doc = load_document(path)
        problems = list(doc.problems)
        if not problems:
            for error in _bench_file_validator().iter_errors(doc.data):
                problems.extend(_problems_for(doc, error))
        if problems:
            raise TopologyError(sort_problems(problems))
        bench, base, source = doc.data["bench"], ("bench",), doc.file
        problems = _rule_problems(doc, bench, base)
    if problems:
        raise TopologyError(sort_problems(problems))
    return BenchSpec(
        topology=topo,
        scenarios=tuple(_scenario(s, Path(source).parent) for s in bench["scenarios"]),
        drain_timeout_s=float(bench.get("drain_timeout_s", BENCH_DRAIN_TIMEOUT_S)),
        source=source,
    )


def kv_shapes(topology_path: str | Path | None) -> list[tuple[str, int, int, int]]:
    """(scenario, input, output, highest concurrency) of the topology's bench scenarios, for
    the release's KV capacity check (hgxserve.release.kvcap); none without a bench section or
    file, or with one that does not load."""
    if not topology_path:
        return []
    try:
        spec = load_bench(topology_path)
    except (HgxserveError, TopologyError, OSError, ValueError):
        return []
    shapes = []
    for s in spec.scenarios:
        points = s.load_points()
        if points and s.input is not None and s.output is not None:
            shapes.append((s.name, s.input, s.output, max(p.concurrency for p in points)))
    return shapes
