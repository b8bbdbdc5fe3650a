"""Time `check_topology` on the largest example against plain jsonschema on yaml.safe_load.

    .venv/bin/python benchmarks/bench_validate.py [--runs 50] [FILE]

Both are measured in the same run, after import and one warm-up call (schema loaded, validator
built). The baseline is what check-jsonschema-style tools do: `jsonschema.validate` on
`yaml.safe_load` output. It reports only the first error, without positions, lets duplicate keys
silently win and runs none of the semantic rules; ours parses with positions, reports every
schema error and runs every rule. Target: < 50 ms per validation of the largest example.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import yaml

from hgxserve.topology import check_topology
from hgxserve.topology.schema import topology_schema

REPO = Path(__file__).resolve().parents[1]
TARGET_MS = 50.0


def largest_example() -> Path:
    return max((REPO / "topologies").rglob("*.yml"), key=lambda p: p.stat().st_size)


def median_ms(func: Callable[[], object], runs: int) -> tuple[float, float]:
    func()  # warm-up: caches, compiled regexes
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        func()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), max(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    path: Path = args.file or largest_example()
    schema = topology_schema()

    def ours() -> object:
        result = check_topology(path)
        assert not result.errors, [p.text() for p in result.errors]
        return result

    def baseline() -> object:
        with open(path, encoding="utf-8") as handle:
            jsonschema.validate(yaml.safe_load(handle), schema)
        return None

    prebuilt = jsonschema.Draft202012Validator(schema)

    def baseline_prebuilt() -> object:
        with open(path, encoding="utf-8") as handle:
            prebuilt.validate(yaml.safe_load(handle))
        return None

    ours_ms, ours_max = median_ms(ours, args.runs)
    base_ms, base_max = median_ms(baseline, args.runs)
    pre_ms, pre_max = median_ms(baseline_prebuilt, args.runs)
    rules = len(__import__("hgxserve.topology.rules", fromlist=["RULES"]).RULES)
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    print(f"file: {rel} ({path.stat().st_size} bytes), {args.runs} runs each, after import")
    print(
        f"hgxserve check_topology (positions, every error, {rules} rules): "
        f"median {ours_ms:.2f} ms, max {ours_max:.2f} ms"
    )
    print(
        f"jsonschema.validate(yaml.safe_load()) (first error, no positions, no rules): "
        f"median {base_ms:.2f} ms, max {base_max:.2f} ms"
    )
    print(
        f"same, validator built once (no per-call schema check): "
        f"median {pre_ms:.2f} ms, max {pre_max:.2f} ms"
    )
    print(f"ratio ours/baseline: {ours_ms / base_ms:.2f}x, ours/prebuilt: {ours_ms / pre_ms:.2f}x")
    verdict = "OK" if ours_ms < TARGET_MS else "TOO SLOW"
    print(f"target < {TARGET_MS:.0f} ms: {verdict}")
    return 0 if ours_ms < TARGET_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
