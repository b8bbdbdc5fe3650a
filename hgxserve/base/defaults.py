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
# The proxy's drain bound (hgxserve.render.proxy.drain_bound_s): output tokens a stream may
# still produce when no routed engine states max_model_len (8192: the longest answer the
# OpenAI-compatible APIs of DeepSeek-V3/R1 give by default), and seconds added to
# tokens x TPOT for the last chunks and the client's own reads.
DRAIN_OUTPUT_TOKENS = 8192
DRAIN_MARGIN_S = 10.0
# Seconds a client is told to wait (Retry-After) when the proxy turns it away while draining
# or paused for a switch: a proxy restart takes about a second, an engine switch minutes, so
# a few seconds keeps retries cheap for the first without a storm during the second.
DRAIN_RETRY_AFTER_S = 5
# systemd's TimeoutStopSec= of the proxy unit exceeds its drain bound by this much: the proxy
# exits by itself once the bound passed, before systemd's SIGKILL.
DRAIN_STOP_SLACK_S = 30
