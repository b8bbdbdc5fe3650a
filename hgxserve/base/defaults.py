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
# The ZMQ topic the engines publish KV events on and the proxy subscribes to (both ends are
# rendered from the topology, so any fixed name works; vLLM's own default is "").
KV_EVENTS_TOPIC = "kv-events"
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
# A bench dataset file (docs/bench.md "Datasets") is read up to this size and line count: seed
# 002's ShareGPT_V3_unfiltered_cleaned_split.json is about 670 MB (94k conversations), so 1 GiB
# holds it; a JSONL prompts file of a million lines is far beyond any round's requests.
BENCH_DATASET_MAX_BYTES = 1 << 30
BENCH_DATASET_MAX_LINES = 1_000_000
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
# bounded by WATCH_READ_TIMEOUT_S (in all, not per recv) and WATCH_READ_LIMIT bytes. The
# watcher's own GET /state (root, on every address) serves only loopback and the engine's hosts,
# WATCH_MAX_CONNECTIONS at once (an engine spans at most a handful of hosts, each polling once
# every WATCH_POLL_S, plus `hgxserve status`), each request read within WATCH_READ_TIMEOUT_S and
# WATCH_REQUEST_LIMIT bytes (a GET /state request is about 100).
# One S3 request's attempts together, backoffs included (hgxserve.weights.s3, docs/weights.md
# "Bounds"). Before, only the attempts were counted: 9 (8 retries), each up to its own budget
# (60 s plus its size at 1 MiB/s: 92 s for a 32 MiB part) plus up to 10 s of backoff, so one
# request against a store that accepts and stalls retried for ~11 min (measured) and up to ~15
# by the bounds. The AWS SDKs' standard retry mode stops after 3 attempts with at most 20 s of
# backoff; 300 s holds three attempts of a 32 MiB part with their backoffs. A request whose one
# attempt may take longer (a larger part) gets that attempt's budget instead. Changed by
# `weights sync --request-deadline` and `--data weights_request_deadline=`.
S3_REQUEST_DEADLINE_S = 300.0
WATCH_POLL_S = 2.0
WATCH_DOWN_AFTER_S = 10.0
WATCH_FOLLOWER_RESTART_S = 180.0 + 120.0
WATCH_BACKOFF_S = 60.0
WATCH_READ_TIMEOUT_S = 3.0
WATCH_READ_LIMIT = 1 << 16
WATCH_MAX_CONNECTIONS = 16
WATCH_REQUEST_LIMIT = 8192
# Fabric preflight (docs/releases.md "Fabric preflight"). Each rail's expected line rate by GPU
# kind, the seeds' figures: the H20 hosts carry 4 x 200 Gb/s RDMA devices per side (seed 003
# §11.4), the H200 hosts one 400 Gb/s NIC per GPU (ConnectX-7 NDR, h100_ibstat.txt's CX-7 rate
# 400); a kind not listed is held to its port's own sysfs rate.
FABRIC_RAIL_GBPS: dict[str, float] = {"H20": 200.0, "H20-3e": 200.0, "H200": 400.0}
# ib_write_bw's average must reach this share of the rail's rate: a healthy ConnectX-7 rail
# measures 90-97% of line rate with perftest's default 64 KiB writes; a rail trained at half
# width or speed, or a congested/misrouted path, measures half or less.
FABRIC_BW_FLOOR = 0.8
# The GID index read on RoCE rails: mlx5 lists link-local RoCE v1/v2 at 0/1 and the port's
# IPv4 address as RoCE v1/v2 at 2/3; NCCL_IB_GID_INDEX=3 is the usual RoCE v2 setting.
FABRIC_GID_INDEX = 3
# perftest's default TCP port for its out-of-band exchange (18515); rail i uses port + i.
FABRIC_PERFTEST_PORT = 18515
# One ib_write_bw run: connection setup plus 5000 x 64 KiB writes takes about 1 s at 200 Gb/s;
# 30 s bounds a hung connection. The servers wait for all rails' clients in turn.
FABRIC_TOOL_TIMEOUT_S = 30
# The NCCL all-reduce across a multi-host engine's hosts (nccl-tests all_reduce_perf, one process
# per host with the engine's GPUs on it, launched by mpirun from the engine's head): nccl-tests'
# bus bandwidth across nodes is bounded by the slowest host's NICs (its rails' rates summed, in
# GB/s); it must reach this share of that. NCCL's ring all-reduce reaches 80-95% of the NICs'
# aggregate on healthy rails; a rail down or at half speed takes its share away.
FABRIC_NCCL_FLOOR = 0.7
# One message size, large enough for bus bandwidth (small sizes measure latency) and small
# enough beside a serving engine's memory: 3 buffers of 256 MiB per GPU plus NCCL's own.
FABRIC_NCCL_BYTES = "256M"
# mpirun's launch, NCCL's init across hosts and 5 + 20 iterations: 1-2 minutes on real hosts.
FABRIC_NCCL_TIMEOUT_S = 300
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

# What a host's switch spends besides its engines' starts: stopping the old units
# (TimeoutStopSec=180 in the rendered engine units), waiting up to GPU_FREE_TIMEOUT_S for their
# GPUs to hold no memory, starting and checking the proxy (60 s).
GPU_FREE_TIMEOUT_S = 300.0
SWITCH_OVERHEAD_S = 180 + GPU_FREE_TIMEOUT_S + 60
# API keys (proxy `auth.api_key`, `auth.engine_api_key`, `auth.metrics_key`, `hgxserve bench
# --api-key-file`): the shortest accepted, in characters. 32 is 128 bits as hex (`openssl rand
# -hex 16`), beyond any online guessing at the proxy's request rate; a typed password or a test
# value is shorter. Key files are also refused unless regular and without group/other permission
# bits (0600 or 0400), and larger than API_KEY_MAX_BYTES is not a key.
MIN_API_KEY_LENGTH = 32
# ... and is one word of printable ASCII (a line break inside a key file made two keys of one,
# or a header no client sends) of at least MIN_API_KEY_DISTINCT distinct characters and no
# shorter pattern repeated: 32 identical characters or `abcd` x 8 are placeholders, not keys. A
# generated key (`openssl rand -hex 32`: 64 characters of 16) has fewer than 8 distinct with a
# probability below 1e-20.
MIN_API_KEY_DISTINCT = 8
API_KEY_MAX_BYTES = 4096
# A `runtime_index_lock` file (hgxserve.runtime.indexlock): vLLM 0.15's full dependency set
# hash-locked by pip-compile is about 150 requirements and 60 KB; 1 MiB leaves room for many
# platforms' hashes and refuses anything that is not a lock.
INDEX_LOCK_MAX_BYTES = 1 << 20
# The system user every venv engine unit runs as (User=/Group=, a group of the same name), and
# the supplementary groups it joins where the host has them: `video` owns /dev/nvidia* when the
# NVIDIA driver restricts its device files (NVreg_DeviceFileMode=0660, NVreg_DeviceFileGID=<gid
# of video> on Ubuntu; the stock driver makes them 0666), `rdma` owns /dev/infiniband/* on sites
# that restrict rdma-core's 0666 default (docs/render.md "Engines run unprivileged"). The cache
# bake starts its engine as the same user, so what it writes is the unit's to write.
ENGINE_USER = "hgxserve-engine"
ENGINE_GROUPS = ("video", "rdma")
ENGINE_SHELL = "/usr/sbin/nologin"
# hgxserve tune (docs/tune.md). Where its runs are kept. One candidate's deploy (the pyinfra run
# of deploys/site.py) is bounded by TUNE_DEPLOY_TIMEOUT_S: a first sync of a 690 GB model at the
# measured 284-350 MiB/s (docs/weights.md) takes 35-40 min, and each engine's start is bounded by
# its start_timeout_s (schema maximum 14400 s; seed 003 measured ~12-23 min), so 4 h covers both.
# The wall-time estimate printed before a tune adds, per bench round, TUNE_ROUND_OVERHEAD_S for
# AIPerf's start-up and the round's idle checks (measured on the test hosts, tests/e2e/test_tune.py:
# twelve rounds of 13.2-34.5 s, 9-26 s of each besides the 12 measured requests), and per
# request without an SLA to bound it TUNE_REQUEST_S (seed 003 §8.4: 4096/128 at C4 took ~6 s per
# request on 8 x H20).
TUNE_RUNS_DIR = "tune-runs"
TUNE_DEPLOY_TIMEOUT_S = 4 * 3600.0
TUNE_ROUND_OVERHEAD_S = 20.0
TUNE_REQUEST_S = 6.0
