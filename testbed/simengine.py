#!/usr/bin/env python3
"""SIMULATED inference engine: speaks the vLLM / SGLang HTTP and P/D protocols without a GPU.

This is test equipment, not an engine. It stands in for `vllm serve` and `sglang serve` on test
hosts (through small shims) and in local tests, so that the proxy, the health gates and the
release switch can be exercised for real: real ports, real SSE, real KV "transfers" over a real
TCP side channel, real GPU-memory bookkeeping that a fake `nvidia-smi` reads back.

    python3 simengine.py --engine vllm serve /models/m --port 8100 --tensor-parallel-size 4 \
        --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
    python3 simengine.py --engine sglang serve --model-path /models/m --port 30000 \
        --disaggregation-mode prefill --disaggregation-bootstrap-port 8998

Python 3 standard library only (test hosts run Debian's python3 with no pip packages).

Environment knobs (all optional):
  HGXSERVE_SIM_START_SECONDS   seconds before the HTTP port opens (default 2), spent printing
                               the real engine's start lines (weight shards n%, compile, CUDA
                               graphs) so the release shows progress as with a real engine
  HGXSERVE_SIM_STOP_SECONDS    seconds GPU memory stays held after SIGTERM (default 1)
  HGXSERVE_SIM_GPU_DIR         GPU memory files dir (default /run/hgxserve-sim/gpus)
  HGXSERVE_SIM_GPU_TOTAL_MIB   per-GPU memory used to size "used_mib" (default 143771, H200)
  HGXSERVE_SIM_TOKEN_SECONDS   time per generated token (default 0.01)
  HGXSERVE_SIM_PREFILL_SECONDS_PER_1K  local prefill time per 1000 prompt tokens (default 0.02)
  HGXSERVE_SIM_EVENT_BYTES     SIMULATED large stream events: every SSE event of a streamed
                               answer is padded to at least this many bytes with a
                               "sim_padding" field no real engine sends (default 0: unpadded),
                               as logprobs or long tool-call deltas make real events large
  HGXSERVE_SIM_TP_EXPONENT     SIMULATED speed by TP and role (sim_speed, sim_prefill, sim_step):
                               per-token and prefill times are divided by TP**exponent (e.g. 0.8:
                               TP8 is ~5.3x TP1), and the engine has one forward pass: prefills
                               run one after the other and each decode step first waits for the
                               prefill running, so a combined engine's TPOT stalls behind new
                               prompts and a P/D decode (which never prefills) does not. Unset:
                               neither applies
  HGXSERVE_SIM_LOOPBACK        address this simulated host's "localhost" means (default
                               127.0.0.1); lets one machine play several hosts: a side channel
                               advertised as localhost/127.0.0.1 resolves to this address
  HGXSERVE_SIM_BOOTSTRAP_WAIT  seconds an SGLang decode waits for its room (default 10)
  HGXSERVE_SIM_JIT=1           log TileLang's kernel-compile line (seed 003 §8.2) the first time a
                               prompt-length bucket (next power of two) is served
  HGXSERVE_SIM_JIT_FILE        while this file exists, the engine behaves as with
                               HGXSERVE_SIM_JIT=1 (default /var/lib/hgxserve-sim/jit): a test turns
                               JIT lines on for one simulated host without changing a topology
  HGXSERVE_SIM_RDMA_DIR        simulated RDMA NIC port counters, <dev>/ports/<n>/counters/
                               port_{xmit,rcv}_data (default /var/lib/hgxserve-sim/infiniband):
                               a cross-host KV transfer adds its bytes there unless the KV
                               goes over TCP (a TCP fallback moves no counter)
  HGXSERVE_SIM_KV_TRANSPORT    tcp: KV to other hosts falls back to TCP (as UCX does when the
                               RDMA NIC cannot be used); rdma; default: tcp when UCX_TLS names
                               no RDMA transport, else rdma
  HGXSERVE_SIM_OTHER_RDMA_BYTES  bytes each generation request adds to the NIC's sent and
                               received counters: the engine's own DP/EP traffic, which moves the
                               host-wide port counters whatever carries the KV (default 0)
  UCX_PROTO_INFO=y             the decode prints UCX's protocol-selection table, in UCX's format,
                               the first time it pulls KV from a peer: `rc_mlx5/<dev>:<port>`
                               over RDMA, `tcp/<interface>` over TCP, `cuda_ipc/cuda` on one host
  HGXSERVE_SIM_KEEP_ALIVE_SECONDS  idle keep-alive connections are closed after this (default 5,
                               uvicorn's timeout_keep_alive, which vLLM and SGLang serve with)
  HGXSERVE_SIM_KV_TOKENS       the KV capacity the engine reports, tokens per DP rank (default
                               max_num_seqs x max_model_len, rounded down to the block size), the
                               way the real one does: vLLM in /metrics `vllm:cache_config_info`
                               (num_gpu_blocks, block_size) and its `GPU KV cache size: N tokens`
                               line; SGLang its `KV Cache is allocated. #tokens: N` line and
                               `max_total_num_tokens` in /get_server_info. A test sets it below
                               the topology's shapes to see the release fail on it
  HGXSERVE_SIM_FAIL            failure injection, comma-separated:
      never_healthy   port opens, /health (and generation) answer 503 forever
      crash_on_start  exit 1 after the start delay, port never opens
      exit_after:N    serve N generation requests, then die abruptly (exit 1, memory files left)
      slow_stop       ignore SIGTERM for HGXSERVE_SIM_SLOW_STOP_SECONDS (default 30)
      garbage         return wrong (random) text, as a broken kernel/executor would
      loopback_side_channel
                      bind and advertise the NIXL side channel on 127.0.0.1 whatever
                      VLLM_NIXL_SIDE_CHANNEL_HOST says (seed 003 §11.3's footgun: a decode on
                      another host cannot reach it and, with recompute, silently recomputes)
      error:CAPTURE   at start, print the real failure captured in CAPTURE.txt (a file of the
                      test hosts' fixtures, e.g. h200_error-802_hf-jobs) and exit 1, as the
                      real engine failing that way would

API keys are enforced as the real engines do: vLLM takes `--api-key` (one or more) or else
VLLM_API_KEY from the environment and then answers 401 {"error": "Unauthorized"} on every /v1
path without `Authorization: Bearer <key>` (/health, /metrics and vLLM's POST /invocations, which
dispatches to completions or chat as real vLLM 0.32 does, stay open: its key middleware checks
/v1 only); SGLang takes
`--api-key` and guards everything but /health* and /metrics the same way.

Prompts understood specially (deterministic, temperature 0):
  "Only answer: X" / "只输出：X" / "只回答：X"  -> the answer is exactly X
  a prompt containing FIRST_TOKEN_EOS          -> the first generated token is EOS (empty answer),
                                                  so a vLLM prefill returns no kv_transfer_params
  a prompt containing SIM_DROP_REQUEST         -> the connection is closed without an answer (one
                                                  request dropped; the engine stays up)

Engines that span hosts (simulated as the real ones behave): the head of a multi-node engine
(vLLM: --data-parallel-size-local below --data-parallel-size, not --headless; SGLang: --nnodes N,
--node-rank 0) listens on its --data-parallel-rpc-port / --dist-init-addr port and opens its API
only once every worker joined (vLLM's DP handshake, torch.distributed's rendezvous): vLLM waits
for the remaining DP ranks, SGLang for nnodes-1 nodes. A worker (--headless / --node-rank > 0)
joins the head there, retrying until it answers, and holds the connection. A worker that dies
after the head served: the head logs the engine's death lines (vLLM: "Engine core ... died
unexpectedly", EngineDeadError; SGLang: "Received sigquit from a child process") and exits 1.
A head that dies: the worker keeps running and serves nothing, as a real worker hangs in NCCL,
until SIGTERM.

Prefix caching (docs/testbed.md "Prefix cache and KV events"): token ids are the UTF-8 bytes
of the rendered prompt (chat: render_chat's format, which the demo model's chat_template
renders too); full blocks are cached per DP rank with LRU eviction at the KV capacity, the
prefill pause covers only the uncached share, and --kv-events-config publishes BlockStored /
BlockRemoved / AllBlocksCleared over ZMQ in the real engines' msgpack format (pyzmq and
msgpack are imported only then; HGXSERVE_SIM_KV_EVENTS_LAYOUT=map: vLLM's events as the named
maps vLLM sends since vllm-project/vllm#42892, else the array layout).

Simulated-only debug endpoints: GET /sim/requests (recent requests: id, kind, KV outcome,
aborted, cached tokens), GET /sim/kv (each DP rank's cached blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import random
import re
import signal
import socket
import struct
import sys
import time
import uuid
from typing import Any

# Flags whose value must be JSON: the real engines reject malformed values at parse time.
JSON_FLAGS = {
    "--kv-transfer-config",
    "--kv-events-config",
    "--reasoning-config",
    "--default-chat-template-kwargs",
    "--speculative-config",
    "--compilation-config",
    "--hf-overrides",
    "--override-generation-config",
    "--model-loader-extra-config",
    "--additional-config",
    "--limit-mm-per-prompt",
    "--json-model-override-args",
    "--disaggregation-ib-device-json",
}
# Flags that take no value (so the next token is not swallowed as their value).
BOOL_FLAGS = {
    "--headless",
    "--enforce-eager",
    "--trust-remote-code",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-auto-tool-choice",
    "--enable-prompt-tokens-details",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-log-stats",
    "--enable-expert-parallel",
    "--enable-eplb",
    "--enable-dbo",
    "--no-async-scheduling",
    "--async-scheduling",
    "--enable-request-id-headers",
    "--enable-metrics",
    "--enable-dp-attention",
    "--disable-cuda-graph",
    "--disable-radix-cache",
    "--skip-server-warmup",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
}
# Flags taking one or more values (argparse nargs="+").
MULTI_FLAGS = {"--served-model-name", "--api-key"}

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
# vLLM's request_time_per_output_token_seconds / inter_token_latency_seconds buckets
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
NIXL_XFER_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
NIXL_POST_BUCKETS = [0.001] + NIXL_XFER_BUCKETS
NIXL_BYTES_BUCKETS = [float(2 ** (10 + i)) for i in range(1, 25, 2)]
NIXL_DESC_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]
SGL_LAT_MS_BUCKETS = [0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]

WORDS = [
    "the",
    "of",
    "and",
    "model",
    "token",
    "prefill",
    "decode",
    "cache",
    "block",
    "layer",
    "head",
    "expert",
    "router",
    "batch",
    "kernel",
    "tensor",
    "graph",
    "memory",
    "stream",
    "queue",
    "request",
    "reply",
    "latency",
    "throughput",
    "shard",
    "weight",
    "rank",
    "node",
    "fabric",
    "switch",
    "link",
    "path",
    "value",
    "key",
    "vector",
    "matrix",
    "sum",
    "mean",
    "scale",
    "norm",
    "gate",
    "unit",
    "step",
    "phase",
    "state",
    "input",
    "output",
    "signal",
    "answer",
    "reason",
    "plan",
    "check",
    "ready",
    "clear",
]
ANSWER_RE = re.compile(
    r"(?:only\s+(?:answer|output|reply|say)|只输出|只回答)\s*[:：]\s*(.+?)\s*$", re.I | re.S
)


def log(msg: str) -> None:
    """Print one log line, flushed (stdout goes to the journal on test hosts)."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [SIMULATED {STATE.engine}] {msg}", flush=True)


def jit_simulated() -> bool:
    """Whether this engine logs simulated JIT compile lines (HGXSERVE_SIM_JIT or its file)."""
    if os.environ.get("HGXSERVE_SIM_JIT") == "1":
        return True
    return os.path.exists(os.environ.get("HGXSERVE_SIM_JIT_FILE") or "/var/lib/hgxserve-sim/jit")


def env_float(name: str, default: float) -> float:
    """Read a float knob from the environment."""
    raw = os.environ.get(name)
    return float(raw) if raw not in (None, "") else default


# --------------------------------------------------------------------------- argument parsing


class ArgError(Exception):
    pass


def parse_args(argv: list[str]) -> dict[str, Any]:
    """Parse `--engine E serve [MODEL] [flags...]` the tolerant way the shims need.

    Example: parse_args(["--engine", "vllm", "serve", "/m", "--port", "8100"])["port"] == "8100"
    """
    args: dict[str, Any] = {"_positional": []}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--"):
            name, eq, inline = tok.partition("=")
            if eq:
                args[name] = inline
                i += 1
                continue
            if name in BOOL_FLAGS:
                args[name] = True
                i += 1
                continue
            if name in MULTI_FLAGS:
                vals = []
                i += 1
                while i < len(argv) and not argv[i].startswith("--"):
                    vals.append(argv[i])
                    i += 1
                args[name] = vals
                continue
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or (nxt.startswith("-") and not re.match(r"^-\d", nxt)):
                args[name] = True
                i += 1
            else:
                args[name] = nxt
                i += 2
        else:
            args["_positional"].append(tok)
            i += 1
    for flag in JSON_FLAGS:
        if flag in args and isinstance(args[flag], str):
            try:
                args[flag] = json.loads(args[flag])
            except json.JSONDecodeError as exc:
                raise ArgError(f"argument {flag}: invalid JSON value: {exc}") from exc
    return args


# --------------------------------------------------------------------------- metrics


class Histogram:
    def __init__(self, buckets: list[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for idx, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[idx] += 1

    def render(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts, strict=True):
            out.append(f'{name}_bucket{{{labels},le="{float(bound)}"}} {count}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.total}')
        out.append(f"{name}_count{{{labels}}} {self.total}")
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        return out


class State:
    """Everything the simulated engine knows about itself."""

    def __init__(self) -> None:
        self.engine = "engine"
        self.ready = False
        self.stopping = False
        self.fail: dict[str, str] = {}
        self.served_names: list[str] = []
        self.model_path = ""
        self.max_model_len = 8192
        self.max_num_seqs = 256
        self.tp = 1
        self.dp_size = 1
        self.dp_local = 1
        self.dp_start = 0
        self.block_size = 16
        self.reasoning_parser: str | None = None
        self.kv: dict[str, Any] = {}
        self.kv_role: str | None = None
        self.engine_id = str(uuid.uuid4())
        self.failure_policy = "recompute"
        self.side_channel_host = "localhost"
        self.side_channel_port = 5600
        self.disagg_mode = "null"
        self.bootstrap_port = 8998
        self.health_generates = False
        self.api_keys: list[bytes] = []  # sha256 digests, compared as vLLM does
        self.running = 0
        self.waiting = 0
        self.served = 0
        self.gpu_files: list[str] = []
        self.recent: list[dict[str, Any]] = []
        # vLLM NIXL: blocks held for remote decode, keyed by first block id
        self.held_blocks: dict[int, dict[str, Any]] = {}
        self.next_block = 1
        # SGLang: KV per bootstrap room
        self.rooms: dict[int, dict[str, Any]] = {}
        self.room_events: dict[int, asyncio.Event] = {}
        self.counters: dict[str, float] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.itl = Histogram(TPOT_BUCKETS)
        self.nixl_xfer = Histogram(NIXL_XFER_BUCKETS)
        self.nixl_post = Histogram(NIXL_POST_BUCKETS)
        self.nixl_bytes = Histogram(NIXL_BYTES_BUCKETS)
        self.nixl_desc = Histogram(NIXL_DESC_BUCKETS)
        self.sgl_xfer_ms = Histogram(SGL_LAT_MS_BUCKETS)
        self.slots: asyncio.Semaphore | None = None
        self.jit_buckets: set[int] = set()
        # an engine that spans hosts: what the head waits for, who joined, whether one died
        self.need_remote = 0
        self.joined: dict[str, int] = {}
        self.joined_event: asyncio.Event | None = None
        self.engine_dead = False
        # prefix caches, one per local DP rank (start_prefix_caches)
        self.prefix_caches: list[PrefixCache] = []

    def inc(self, key: str, value: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    def record(self, entry: dict[str, Any]) -> None:
        self.recent.append(entry)
        del self.recent[:-1000]


STATE = State()


def kv_tokens() -> int:
    """The KV capacity this engine reports, per DP rank (HGXSERVE_SIM_KV_TOKENS)."""
    s = STATE
    block = max(1, s.block_size)
    default = s.max_num_seqs * s.max_model_len // block * block
    return int(env_float("HGXSERVE_SIM_KV_TOKENS", default))


def kv_usage() -> float:
    """Share of the KV cache in use (simulated: running requests and KV held for a decode,
    against max_num_seqs slots)."""
    s = STATE
    return round(min(1.0, (s.running + len(s.held_blocks)) / max(1, s.max_num_seqs)), 4)


def observe_decode(first: float, gaps: list[float]) -> None:
    """TPOT of one request and its inter-token gaps, as vLLM records them."""
    for gap in gaps:
        STATE.itl.observe(gap)
    if gaps:
        STATE.tpot.observe((time.monotonic() - first) / len(gaps))


def render_metrics() -> str:
    """Prometheus text with the real engines' metric names."""
    s = STATE
    c = s.counters.get
    name = s.served_names[0] if s.served_names else s.model_path
    lines: list[str] = []
    if s.engine == "vllm":
        lab = f'engine="0",model_name="{name}"'
        lines += [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {s.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {s.waiting}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lab}}} {c('prompt_tokens', 0)}",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
        ]
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            val = c(f"prompt_src:{src}", 0)
            lines.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{src}"}} {val}')
        lines += [
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {c('generation_tokens', 0)}",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort"):
            val = c(f"finished:{reason}", 0)
            lines.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {val}')
        lines += s.ttft.render("vllm:time_to_first_token_seconds", lab)
        lines += s.e2e.render("vllm:e2e_request_latency_seconds", lab)
        lines += s.tpot.render("vllm:request_time_per_output_token_seconds", lab)
        lines += s.itl.render("vllm:inter_token_latency_seconds", lab)
        lines += [
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {kv_usage()}",
            # vLLM's CacheConfig as an info gauge (vllm/v1/metrics/loggers.py log_metrics_info)
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{s.block_size}",cache_dtype="auto",'
            f'engine="0",gpu_memory_utilization="0.9",'
            f'num_gpu_blocks="{kv_tokens() // max(1, s.block_size)}"}} 1.0',
        ]
        lines += prefix_cache_metrics()
        if s.kv.get("kv_connector") == "NixlConnector":
            lines += s.nixl_xfer.render("vllm:nixl_xfer_time_seconds", lab)
            lines += s.nixl_post.render("vllm:nixl_post_time_seconds", lab)
            lines += s.nixl_bytes.render("vllm:nixl_bytes_transferred", lab)
            lines += s.nixl_desc.render("vllm:nixl_num_descriptors", lab)
            for key in ("failed_transfers", "failed_notifications", "kv_expired_reqs"):
                lines += [
                    f"# TYPE vllm:nixl_num_{key} counter",
                    f"vllm:nixl_num_{key}_total{{{lab}}} {c('nixl:' + key, 0)}",
                ]
    else:
        lab = f'model_name="{name}"'
        lines += [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{lab}}} {s.running}",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{lab}}} {s.waiting}",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{lab}}} {c('prompt_tokens', 0)}",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{lab}}} {c('generation_tokens', 0)}",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{{{lab}}} {c('requests', 0)}",
            "# TYPE sglang:num_aborted_requests_total counter",
            f"sglang:num_aborted_requests_total{{{lab}}} {c('finished:abort', 0)}",
        ]
        lines += s.ttft.render("sglang:time_to_first_token_seconds", lab)
        lines += s.e2e.render("sglang:e2e_request_latency_seconds", lab)
        lines += s.itl.render("sglang:inter_token_latency_seconds", lab)
        lines += ["# TYPE sglang:token_usage gauge", f"sglang:token_usage{{{lab}}} {kv_usage()}"]
        lines += prefix_cache_metrics()
        if s.disagg_mode != "null":
            lines += s.sgl_xfer_ms.render("sglang:kv_transfer_latency_ms", lab)
            for key in ("bootstrap_failed_reqs", "transfer_failed_reqs"):
                lines += [
                    f"# TYPE sglang:num_{key}_total counter",
                    f"sglang:num_{key}_total{{{lab}}} {c('sgl:' + key, 0)}",
                ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- text generation


def prompt_of(body: dict[str, Any], chat: bool) -> str:
    """The request's prompt text (chat: the messages' text joined)."""
    if chat:
        parts = []
        for msg in body.get("messages") or []:
            content = msg.get("content")
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(str(content or ""))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return " ".join(str(t) for t in prompt)
        if len(prompt) > 1:
            raise ValueError("simulated engine: batched prompts are not supported")
        prompt = prompt[0] if prompt else ""
    return str(prompt)


def count_prompt_tokens(body: dict[str, Any], text: str, chat: bool) -> int:
    """Token count: ids are counted exactly, text as ~4 characters per token."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    extra = 4 * len(body.get("messages") or []) if chat else 0
    return max(1, math.ceil(len(text.encode()) / 4)) + extra


def last_user_text(body: dict[str, Any], chat: bool, text: str) -> str:
    if not chat:
        return text
    for msg in reversed(body.get("messages") or []):
        if msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return text


def plan_tokens(body: dict[str, Any], text: str, chat: bool) -> tuple[list[str], list[str], str]:
    """Decide (reasoning tokens, answer tokens, natural finish) for a request, deterministically."""
    seed_src = f"{text}|{body.get('seed', '')}"
    temperature = body.get("temperature", 1.0)
    if temperature not in (0, 0.0) and "seed" not in body:
        seed_src += str(random.random())
    rng = random.Random(hashlib.sha256(seed_src.encode()).hexdigest())
    if "garbage" in STATE.fail:
        junk = [
            chr(rng.randrange(0x4E00, 0x9FA5)) + rng.choice(["}", "ä", "_x", ";;"])
            for _ in range(rng.randrange(8, 24))
        ]
        return [], [t + " " for t in junk], "stop"
    reasoning: list[str] = []
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", True))
    if chat and STATE.reasoning_parser and thinking is not False:
        reasoning = [w + " " for w in ["Let", "me", "think:"] + rng.sample(WORDS, 5)]
    if "FIRST_TOKEN_EOS" in text:
        return reasoning, [], "stop"
    match = ANSWER_RE.search(last_user_text(body, chat, text))
    if match:
        return reasoning, [match.group(1)], "stop"
    n = 16 + rng.randrange(48)
    return reasoning, [rng.choice(WORDS) + " " for _ in range(n)], "stop"


# ------------------------------------------------------------------- prefix cache and KV events
#
# SIMULATED prefix caching. Token ids are the UTF-8 bytes of the rendered prompt (chat: the chat
# format below; the demo model's tokenizer.json and chat_template give the same ids). The cache
# keeps full blocks of token ids per DP rank, chained by hash (as vLLM's and SGLang's caches),
# evicts least recently used blocks at the KV capacity (kv_tokens()), and publishes the changes
# in vLLM's / SGLang's KV-event wire format when --kv-events-config asks for it. The counts the
# engine reports (usage, prompt token metrics, the context-length check) stay the ~4 bytes per
# token estimate of count_prompt_tokens; the cached share scales them.

KV_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU


def render_chat(body: dict[str, Any]) -> str:
    """The simulated engine's chat format (the demo model's chat_template renders the same):
    `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` unless add_generation_prompt is
    false. List contents join their parts' text with one space.

    Example: render_chat({"messages": [{"role": "user", "content": "hi"}]})
    == "<|user|>\\nhi\\n<|assistant|>\\n"
    """
    out = []
    for msg in body.get("messages") or []:
        content = msg.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        elif not isinstance(content, str):
            content = ""
        out.append(f"<|{msg.get('role') or ''}|>\n{content}\n")
    if body.get("add_generation_prompt", True):
        out.append("<|assistant|>\n")
    return "".join(out)


def prompt_token_ids(body: dict[str, Any], text: str, chat: bool) -> list[int]:
    """The prompt's token ids: the given ids, else the UTF-8 bytes of the rendered prompt."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [int(t) for t in prompt]
    return list((render_chat(body) if chat else text).encode("utf-8"))


class PrefixCache:
    """One DP rank's simulated prefix cache: full blocks keyed by a chain hash, LRU order."""

    def __init__(self, rank: int, block_size: int, capacity_blocks: int, seed: bytes) -> None:
        self.rank = rank
        self.block_size = block_size
        self.capacity = max(0, capacity_blocks)
        self.seed = seed  # a per-start hash seed, as the real engines' (PYTHONHASHSEED etc.)
        # own hash -> (parent hash, token ids); insertion order = LRU order (last: most recent)
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}
        self.publisher: KvEventPublisher | None = None
        self.inflight = 0

    def chain(self, ids: list[int], nblocks: int) -> list[tuple[int, int | None, list[int]]]:
        """(hash, parent hash, token ids) of the first nblocks full blocks of ids."""
        out: list[tuple[int, int | None, list[int]]] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(nblocks):
            toks = ids[i * bs : (i + 1) * bs]
            digest = hashlib.sha256(
                self.seed + (parent or 0).to_bytes(8, "big") + struct.pack(f"<{bs}I", *toks)
            ).digest()
            own = int.from_bytes(digest[:8], "big")
            out.append((own, parent, toks))
            parent = own
        return out

    def touch(self, hashes: list[int]) -> None:
        """Mark blocks used: children older than their parents, so a chain evicts tail first."""
        for own in reversed(hashes):
            self.blocks[own] = self.blocks.pop(own)

    def lookup(self, ids: list[int], chain: list[tuple[int, int | None, list[int]]]) -> int:
        """Cached prefix length in tokens of `ids` (whose full blocks are `chain`): whole blocks,
        and never the last prompt token (vLLM's max_cache_hit_length); refreshes the hits."""
        hit: list[int] = []
        for own, _parent, _toks in chain[: max(0, len(ids) - 1) // self.block_size]:
            if own not in self.blocks:
                break
            hit.append(own)
        self.touch(hit)
        return len(hit) * self.block_size

    def store(self, chain: list[tuple[int, int | None, list[int]]]) -> None:
        """Cache the prompt's full blocks, evicting LRU blocks for room; publish the changes."""
        chain = chain[: self.capacity]
        mine = {own for own, _p, _t in chain}
        events: list[list[Any]] = []
        run: list[tuple[int, int | None, list[int]]] = []
        for link in chain + [(0, None, [])]:  # a sentinel closes the last run
            if link[2] and link[0] not in self.blocks:
                removed = self.evict(len(self.blocks) + 1 - self.capacity, mine)
                if removed:
                    events.append(self.removed_event(removed))
                self.blocks[link[0]] = (link[1], link[2])
                run.append(link)
                continue
            if run:
                events.append(self.stored_event(run))
                run = []
        self.touch([own for own, _p, _t in chain])
        self.publish(events)

    def evict(self, count: int, keep: set[int]) -> list[int]:
        removed = []
        for own in list(self.blocks):
            if len(removed) >= count:
                break
            if own not in keep:
                del self.blocks[own]
                removed.append(own)
        return removed

    def clear(self) -> None:
        self.blocks.clear()
        self.publish([["AllBlocksCleared"]])

    def stored_event(self, run: list[tuple[int, int | None, list[int]]]) -> list[Any]:
        tokens = [t for _own, _parent, toks in run for t in toks]
        event = ["BlockStored", [r[0] for r in run], run[0][1], tokens, self.block_size, None]
        if STATE.engine == "vllm":
            event += [KV_MEDIUM, None]  # medium, lora_name (vLLM >= 0.10)
        return event

    def removed_event(self, hashes: list[int]) -> list[Any]:
        return ["BlockRemoved", hashes] + ([KV_MEDIUM] if STATE.engine == "vllm" else [])

    def publish(self, events: list[list[Any]]) -> None:
        if events and self.publisher is not None:
            if STATE.engine == "vllm" and os.environ.get("HGXSERVE_SIM_KV_EVENTS_LAYOUT") == "map":
                events = [vllm_map_event(e) for e in events]
            batch: list[Any] = [time.time(), events]
            if STATE.engine == "vllm":
                batch.append(self.rank)  # vLLM's publisher fills data_parallel_rank
            self.publisher.put(batch)


def vllm_map_event(event: list[Any]) -> dict[str, Any]:
    """An event as vLLM publishes it since its structs dropped array_like (vllm-project/vllm
    #42892, in 0.26 and later): a map tagged by "type" with the fields' names, the EventBatch
    around it still an array. HGXSERVE_SIM_KV_EVENTS_LAYOUT=map selects it."""
    if event[0] == "BlockStored":
        names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name")  # fmt: skip
        out = {"type": event[0], **dict(zip(names, event[1:], strict=True))}
        out.update(extra_keys=[None] * len(event[1]), group_idx=0)
        out["kv_cache_spec_kind"] = "full_attention"
        return out
    if event[0] == "BlockRemoved":
        return {"type": event[0], "block_hashes": event[1], "medium": event[2], "group_idx": 0}
    return {"type": event[0]}


# Debian's python3-zmq and python3-msgpack (the test image's): a runtime venv on a test host is
# made with `python3 -m venv`, without the system's site-packages, so they are looked up here
# when the venv itself has no pyzmq/msgpack.
SYSTEM_DIST_PACKAGES = "/usr/lib/python3/dist-packages"


def kv_event_modules() -> tuple[Any, Any]:
    """(zmq, msgpack), imported only with --kv-events-config (the sim is stdlib-only otherwise):
    from this Python's path, else from HGXSERVE_SIM_DIST_PACKAGES or Debian's dist-packages."""
    try:
        import msgpack
        import zmq
    except ImportError:
        sys.path.append(os.environ.get("HGXSERVE_SIM_DIST_PACKAGES") or SYSTEM_DIST_PACKAGES)
        import msgpack
        import zmq
    return zmq, msgpack


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's / SGLang's ZmqEventPublisher.offset_endpoint_port: DP rank N adds N to the port."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


class KvEventPublisher:
    """The real engines' ZmqEventPublisher, re-done: a thread owning a PUB socket (topic, 8-byte
    big-endian seq, msgpack payload) and a ROUTER replay socket answering a start seq with the
    buffered batches from it, then the end marker (seq -1)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: dict[str, Any], rank: int) -> None:
        import queue
        import threading

        zmq, msgpack = kv_event_modules()
        self.zmq, self.pack = zmq, msgpack.packb
        self.queue: queue.Queue[list[Any] | None] = queue.Queue()
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_steps = int(config.get("buffer_steps", 10_000))
        self.topic = str(config.get("topic") or "").encode()
        self.endpoint = offset_endpoint_port(config.get("endpoint") or "tcp://*:5557", rank)
        self.replay_endpoint = offset_endpoint_port(config.get("replay_endpoint"), rank)
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(int(config.get("hwm", 100_000)))
        assert self.endpoint is not None
        # the real publisher's heuristic: bind a wildcard (or ipc/inproc) address, else connect
        wildcard = "*" in self.endpoint or "::" in self.endpoint
        if wildcard or self.endpoint.startswith(("ipc://", "inproc://")):
            self.pub.bind(self.endpoint)
        else:
            self.pub.connect(self.endpoint)
        self.replay = None
        if self.replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.bind(self.replay_endpoint)
        self.seq = 0
        self.thread = threading.Thread(target=self.run, daemon=True, name="kv-events")
        self.thread.start()

    def put(self, batch: list[Any]) -> None:
        self.queue.put(batch)

    def run(self) -> None:
        import queue

        while True:
            if self.replay is not None and self.replay.poll(0):
                self.serve_replay()
            try:
                batch = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = self.pack(batch, use_bin_type=True)
            self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
            self.buffer.append((self.seq, payload))
            del self.buffer[: -self.buffer_steps]
            self.seq += 1
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

    def serve_replay(self) -> None:
        assert self.replay is not None
        frame = self.replay.recv_multipart()
        if len(frame) != 3:
            log(f"KV events: invalid replay request ({len(frame)} frames)")
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= first:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", self.END_SEQ, b""))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=1.0)


def prefix_caching_on(args: dict[str, Any]) -> bool:
    """vLLM V1 caches prefixes unless --no-enable-prefix-caching; SGLang unless
    --disable-radix-cache."""
    if STATE.engine == "vllm":
        return args.get("--no-enable-prefix-caching") is not True
    return args.get("--disable-radix-cache") is not True


def kv_events_config(args: dict[str, Any]) -> dict[str, Any] | None:
    """--kv-events-config when it asks for a ZMQ publisher (vLLM: enable_kv_cache_events too)."""
    config = args.get("--kv-events-config")
    if not isinstance(config, dict) or config.get("publisher", "null") == "null":
        return None
    if STATE.engine == "vllm" and not config.get("enable_kv_cache_events"):
        return None
    if config.get("publisher") != "zmq":
        raise ArgError(f"Unknown event publisher '{config.get('publisher')}'")
    return config


def start_prefix_caches(args: dict[str, Any]) -> None:
    """One cache per local DP rank, each with its publisher when --kv-events-config asks;
    every publisher starts with AllBlocksCleared (a fresh engine holds nothing)."""
    s = STATE
    if not prefix_caching_on(args):
        return
    config = kv_events_config(args)
    seed = os.urandom(8)
    capacity = kv_tokens() // max(1, s.block_size)
    first = s.dp_start if s.engine == "vllm" else 0
    for rank in range(first, first + (s.dp_local if s.engine == "vllm" else s.dp_size)):
        cache = PrefixCache(rank, s.block_size, capacity, seed)
        if config is not None:
            cache.publisher = KvEventPublisher(config, rank)
            log(
                f"KV events (simulated) dp_rank={rank}: PUB {cache.publisher.endpoint} "
                f"replay {cache.publisher.replay_endpoint} topic {config.get('topic') or ''!r}"
            )
            cache.clear()
        s.prefix_caches.append(cache)


def stop_prefix_caches() -> None:
    for cache in STATE.prefix_caches:
        if cache.publisher is not None:
            cache.publisher.close()


def prefix_plan(body: dict[str, Any], text: str, chat: bool, prompt_tokens: int,
                headers: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """Pick the DP rank (X-data-parallel-rank, else the least busy, as vLLM's DP balancing) and
    look the prompt up in its cache. `cached` is in the reported count's units."""
    s = STATE
    plan: dict[str, Any] = {"cache": None, "ids": [], "cached": 0, "cached_ids": 0}
    if not s.prefix_caches:
        return plan
    asked = headers.get("x-data-parallel-rank")
    caches = [c for c in s.prefix_caches if str(c.rank) == asked] or s.prefix_caches
    cache = min(caches, key=lambda c: c.inflight)
    ids = prompt_token_ids(body, text, chat)
    chain = cache.chain(ids, len(ids) // cache.block_size)
    hit = cache.lookup(ids, chain)
    cache.inflight += 1
    plan.update(cache=cache, ids=ids, chain=chain, cached_ids=hit)
    plan["cached"] = prompt_tokens * hit // max(1, len(ids))
    s.inc("prefix_cache_queries", prompt_tokens)
    s.inc("prefix_cache_hits", plan["cached"])
    return plan


def prefix_store(plan: dict[str, Any]) -> None:
    """The prompt's KV is built (computed or transferred): its full blocks are cached now, as
    the real engines cache each block once computed."""
    if plan["cache"] is not None:
        plan["cache"].store(plan["chain"])


def prefix_done(plan: dict[str, Any]) -> None:
    """The request left the engine."""
    if plan["cache"] is not None:
        plan["cache"].inflight -= 1


def prefix_cache_state() -> dict[str, Any]:
    """GET /sim/kv: each rank's cached blocks (LRU order), for tests."""
    return {
        "simulated": True,
        "block_size": STATE.block_size,
        "ranks": [
            {
                "rank": c.rank,
                "capacity_blocks": c.capacity,
                "blocks": [
                    {"hash": own, "parent": parent, "token_ids": toks}
                    for own, (parent, toks) in c.blocks.items()
                ],
            }
            for c in STATE.prefix_caches
        ],
    }


def prefix_cache_metrics() -> list[str]:
    """vLLM's prefix-cache counters (tokens) / SGLang's cache hit rate gauge."""
    s = STATE
    c = s.counters.get
    name = s.served_names[0] if s.served_names else s.model_path
    if s.engine == "vllm":
        lab = f'engine="0",model_name="{name}"'
        return [
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{lab}}} {c('prefix_cache_queries', 0)}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{lab}}} {c('prefix_cache_hits', 0)}",
        ]
    rate = c("prefix_cache_hits", 0) / max(1.0, c("prefix_cache_queries", 0))
    return [
        "# TYPE sglang:cache_hit_rate gauge",
        f'sglang:cache_hit_rate{{model_name="{name}"}} {round(rate, 6)}',
    ]


# --------------------------------------------------------------------------- HTTP plumbing


class Conn:
    """One client connection: a minimal HTTP/1.1 server side with keep-alive and chunking."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def gone(self) -> bool:
        return self.reader.at_eof() or self.writer.is_closing()

    async def send(
        self,
        status: int,
        body: bytes,
        ctype: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        head = [
            f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}",
            f"content-type: {ctype}",
            f"content-length: {len(body)}",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await self.writer.drain()

    async def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json.dumps(obj).encode(), headers=headers)

    async def start_stream(self, headers: dict[str, str] | None = None) -> None:
        head = [
            "HTTP/1.1 200 OK",
            "content-type: text/event-stream; charset=utf-8",
            "transfer-encoding: chunked",
            "cache-control: no-cache",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        await self.writer.drain()

    async def chunk(self, data: bytes) -> None:
        self.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await self.writer.drain()

    async def end_stream(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    411: "Length Required",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def error_body(status: int, message: str, etype: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": None, "code": status}}


class Aborted(Exception):
    pass


async def pause(conn: Conn | None, seconds: float) -> None:
    """Sleep, noticing a client that went away (so its request is aborted, as vLLM does)."""
    end = time.monotonic() + seconds
    while True:
        if conn is not None and conn.gone():
            raise Aborted()
        left = end - time.monotonic()
        if left <= 0:
            return
        # a quarter second at most between looks: 1000 requests in flight stay cheap
        await asyncio.sleep(min(left, 0.25))


# ------------------------------------------------ SIMULATED speed by TP and role (opt-in knob)

_SIM_PREFILL_ENDS: list[float] = []  # when this engine's queued prefills end, in order


def sim_speed(seconds: float) -> float:
    """A step's time on this engine: seconds / TP**HGXSERVE_SIM_TP_EXPONENT (unset: seconds)."""
    exponent = env_float("HGXSERVE_SIM_TP_EXPONENT", 0.0)
    return seconds / STATE.tp**exponent if exponent else seconds


async def sim_prefill(conn: Conn | None, seconds: float) -> None:
    """A prefill; with the TP knob set it queues behind this engine's earlier prefills."""
    if not env_float("HGXSERVE_SIM_TP_EXPONENT", 0.0):
        await pause(conn, seconds)
        return
    now = time.monotonic()
    _SIM_PREFILL_ENDS[:] = [e for e in _SIM_PREFILL_ENDS if e > now]
    end = max([now, *_SIM_PREFILL_ENDS]) + seconds
    _SIM_PREFILL_ENDS.append(end)
    await pause(conn, end - time.monotonic())


async def sim_step(conn: Conn | None, seconds: float, first: bool) -> None:
    """A token; with the TP knob set a decode step (not the first token, which the request's
    own prefill produces) first waits for the prefill this engine is running."""
    if env_float("HGXSERVE_SIM_TP_EXPONENT", 0.0) and not first:
        now = time.monotonic()
        running = [e for e in _SIM_PREFILL_ENDS if e > now]
        if running:
            await pause(conn, min(running) - now)
    await pause(conn, seconds)


async def handle_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    conn = Conn(reader, writer)
    # as uvicorn under vLLM and SGLang: an idle keep-alive connection is closed after 5 s
    keep_alive = env_float("HGXSERVE_SIM_KEEP_ALIVE_SECONDS", 5.0)
    try:
        while not STATE.stopping:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), keep_alive)
            except (
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ConnectionError,
                TimeoutError,
            ):
                break
            lines = head.decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
            except ValueError:
                break
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    key, _, value = line.partition(":")
                    headers[key.strip().lower()] = value.strip()
            if headers.get("transfer-encoding", "").lower() == "chunked":
                await conn.send_json(411, error_body(411, "chunked request bodies not supported"))
                break
            length = int(headers.get("content-length", "0") or 0)
            body = await reader.readexactly(length) if length else b""
            await route(conn, method, target.split("?", 1)[0], headers, body)
            if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
                break
    except (ConnectionError, asyncio.IncompleteReadError, Aborted):
        pass
    finally:
        writer.close()


def authorized(path: str, headers: dict[str, str]) -> bool:
    """The engine's API-key check: vLLM guards /v1 paths, SGLang all but /health* and /metrics."""
    s = STATE
    if not s.api_keys or method_exempt(path):
        return True
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
    match = False
    for key in s.api_keys:
        match |= hmac.compare_digest(digest, key)
    return match


def method_exempt(path: str) -> bool:
    if STATE.engine == "vllm":
        return not path.startswith("/v1")
    return path.startswith("/health") or path.startswith("/metrics")


async def route(conn: Conn, method: str, path: str, headers: dict[str, str], raw: bytes) -> None:
    s = STATE
    if method != "OPTIONS" and not authorized(path, headers):
        s.inc("unauthorized")
        await conn.send_json(401, {"error": "Unauthorized"})
        return
    if path == "/health" and method == "GET":
        if "never_healthy" in s.fail:
            await conn.send(503, b"")
        elif s.engine == "sglang" and s.health_generates:
            # SGLang's default /health runs a real one-token generation (seed 003 §12.4).
            await health_generate()
            await conn.send(200, b"")
        else:
            await conn.send(200, b"")
    elif path == "/health_generate" and method == "GET" and s.engine == "sglang":
        await health_generate()
        await conn.send(200, b"")
    elif path == "/metrics" and method == "GET":
        await conn.send(200, render_metrics().encode(), ctype="text/plain; version=0.0.4")
    elif path == "/v1/models" and method == "GET":
        now = int(time.time())
        data = [
            {
                "id": n,
                "object": "model",
                "created": now,
                "owned_by": s.engine,
                "root": s.model_path,
                "parent": None,
                "max_model_len": s.max_model_len,
                "permission": [],
            }
            for n in s.served_names
        ]
        await conn.send_json(200, {"object": "list", "data": data})
    elif path in ("/get_server_info", "/server_info") and method == "GET" and s.engine == "sglang":
        # SGLang merges its scheduler's init info (max_total_num_tokens) into the server info
        await conn.send_json(
            200,
            {
                "model_path": s.model_path,
                "tp_size": s.tp,
                "dp_size": s.dp_size,
                "max_total_num_tokens": kv_tokens(),
                "version": "0.0.0+simulated",
            },
        )
    elif path == "/version" and method == "GET" and s.engine == "vllm":
        # vLLM answers {"version": "..."}; this one says it is simulated
        await conn.send_json(200, {"version": "0.0.0+simulated"})
    elif path == "/sim/requests" and method == "GET":
        await conn.send_json(200, {"simulated": True, "requests": s.recent})
    elif path == "/sim/kv" and method == "GET":
        await conn.send_json(200, prefix_cache_state())
    elif (path, method, s.engine) in (
        ("/reset_prefix_cache", "POST", "vllm"),
        ("/flush_cache", "POST", "sglang"),
        ("/flush_cache", "GET", "sglang"),
    ):
        for cache in s.prefix_caches:  # the real ones publish AllBlocksCleared
            cache.clear()
        await conn.send(200, b"")
    elif (
        path in ("/v1/completions", "/v1/chat/completions")
        or (path == "/invocations" and s.engine == "vllm")
    ) and method == "POST":
        if "never_healthy" in s.fail:
            await conn.send_json(
                503, error_body(503, "engine is not healthy", "ServiceUnavailable")
            )
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
            # as vLLM's request parsing (pydantic): lone surrogates are not valid text
            json.dumps(body, ensure_ascii=False).encode()
        except ValueError as exc:  # UnicodeEncodeError included
            await conn.send_json(400, error_body(400, f"invalid JSON body: {exc}"))
            return
        # /invocations (vLLM's SageMaker route) takes either body: chat when it has messages
        chat = path.endswith("chat/completions") or (path == "/invocations" and "messages" in body)
        await generate(conn, body, headers, chat=chat)
        s.served += 1
        limit = s.fail.get("exit_after")
        if limit is not None and s.served >= int(limit):
            log(f"simulated failure exit_after:{limit}: dying after {s.served} requests")
            os._exit(1)
    else:
        await conn.send_json(404, error_body(404, f"Not Found: {path}", "NotFoundError"))


async def health_generate() -> None:
    STATE.inc("prompt_tokens", 1)
    STATE.inc("generation_tokens", 1)
    STATE.inc("requests")
    STATE.inc("finished:length")
    STATE.ttft.observe(0.001)
    STATE.e2e.observe(0.001)


# --------------------------------------------------------------------------- KV transfer


RDMA_TRANSPORTS = {"all", "rc", "rc_x", "rc_v", "rc_mlx5", "ud", "ud_x", "ud_v", "ud_mlx5", "dc",
                   "dc_x", "dc_mlx5", "ib"}  # fmt: skip
_said_tcp = False
_proto_info_said: set[str] = set()


def kv_transport() -> str:
    """SIMULATED UCX transport selection for KV to another host: "tcp" when
    HGXSERVE_SIM_KV_TRANSPORT=tcp (a fallback the real UCX takes when the RDMA NIC cannot be
    used, e.g. a down port or a wrong UCX_NET_DEVICES) or when UCX_TLS names no RDMA transport;
    else "rdma"."""
    forced = os.environ.get("HGXSERVE_SIM_KV_TRANSPORT", "").strip().lower()
    if forced in ("tcp", "rdma"):
        return forced
    tls = [t.strip().lower() for t in os.environ.get("UCX_TLS", "").split(",") if t.strip()]
    return "tcp" if tls and not RDMA_TRANSPORTS.intersection(tls) else "rdma"


def _nic() -> tuple[str, str]:
    """(device, port) of the simulated RDMA NIC UCX would use: UCX_NET_DEVICES' first entry,
    else the first device under HGXSERVE_SIM_RDMA_DIR ("" when there is none)."""
    root = os.environ.get("HGXSERVE_SIM_RDMA_DIR") or "/var/lib/hgxserve-sim/infiniband"
    wanted = os.environ.get("UCX_NET_DEVICES", "all").split(",")[0].strip()
    device, _, port = wanted.partition(":")
    if device in ("", "all"):
        found = sorted(os.listdir(root)) if os.path.isdir(root) else []
        device, port = (found[0] if found else ""), "1"
    return device, port or "1"


def _bump(counter: str, nbytes: int) -> None:
    """Add bytes to this host's simulated NIC port counter (4-byte words, as InfiniBand's)."""
    root = os.environ.get("HGXSERVE_SIM_RDMA_DIR") or "/var/lib/hgxserve-sim/infiniband"
    device, port = _nic()
    path = os.path.join(root, device, "ports", port, "counters", counter)
    if nbytes <= 0 or not device or not os.path.isfile(path):
        return  # no (simulated) NIC here
    with open(path, encoding="ascii") as fh:
        value = int(fh.read().strip() or 0)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"{value + nbytes // 4}\n")
    os.replace(tmp, path)


def other_rdma_traffic() -> None:
    """SIMULATED DP/EP traffic of the engine itself (its all-to-all over the same NICs):
    HGXSERVE_SIM_OTHER_RDMA_BYTES per generation request, sent and received, whatever carries
    the KV. It moves the host-wide port counters the way a real DP/EP engine's does."""
    nbytes = int(env_float("HGXSERVE_SIM_OTHER_RDMA_BYTES", 0))
    _bump("port_xmit_data", nbytes)
    _bump("port_rcv_data", nbytes)


SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def _iface_of(address: str) -> str:
    """The network interface holding `address` (Linux SIOCGIFADDR), else "eth0"."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return "eth0"


def proto_info(local: str, peer: str, operation: str) -> None:
    """With UCX_PROTO_INFO=y, print UCX's protocol-selection table for this engine's KV
    endpoint to `peer` the first time it is used, in UCX's format (src/ucp/proto/proto_debug.c,
    ucp_proto_select_elem_info, behind the compact log prefix `[<time>] [<host>:<pid>:<thread>]`):
    a KV read over RDMA is `zero-copy` on `rc_mlx5/<device>:<port>`, over TCP `software
    emulation` on `tcp/<interface>`."""
    if os.environ.get("UCX_PROTO_INFO", "").lower() not in ("y", "yes", "1", "on", "true"):
        return
    same = peer == local or peer.startswith("127.") or peer in ("::1", "localhost")
    if f"{peer} {operation}" in _proto_info_said:
        return
    _proto_info_said.add(f"{peer} {operation}")
    if same:
        endpoint, desc, lanes = "intra-node", "zero-copy", "cuda_ipc/cuda"
    elif kv_transport() == "tcp":
        endpoint, desc, lanes = "inter-node", "software emulation", f"tcp/{_iface_of(local)}"
    else:
        device, port = _nic()
        endpoint, desc, lanes = "inter-node", "zero-copy", f"rc_mlx5/{device or 'mlx5_0'}:{port}"
    ep = f"ucp_context_0 {endpoint} cfg#{len(_proto_info_said)}"
    rng = "0..inf"
    w0 = max(len(ep), len(rng))
    w2 = len(lanes)
    w1 = max(len(desc), len(operation) - w2)
    hdr1 = w1 + 3 + w2
    sep2 = f"+{'-' * (w0 + 2)}+{'-' * (hdr1 + 2)}+"
    sep3 = f"+{'-' * (w0 + 2)}+{'-' * (w1 + 2)}+{'-' * (w2 + 2)}+"
    rows = [sep2, f"| {ep:>{w0}} | {operation:<{hdr1}} |", sep3,
            f"| {rng:>{w0}} | {desc:<{w1}} | {lanes:<{w2}} |", sep3]  # fmt: skip
    host = os.uname().nodename
    for row in rows:
        now = time.time()
        print(f"[{now:.6f}] [{host}:{os.getpid()}:0]   {row}", flush=True)


def rdma_count(counter: str, nbytes: int, local: str, peer: str) -> None:
    """SIMULATED RDMA NIC: add a cross-host KV transfer's bytes to this host's port counter
    (`port_xmit_data` on the sender, `port_rcv_data` on the receiver; 4-byte words, as the
    InfiniBand counters count). Nothing moves for a transfer inside one host (CUDA IPC), or
    when the KV goes over TCP (kv_transport)."""
    global _said_tcp
    if nbytes <= 0 or peer == local or peer.startswith("127.") or peer in ("::1", "localhost"):
        return
    if kv_transport() == "tcp":
        if not _said_tcp:
            log("KV to other hosts goes over TCP (simulated UCX fallback), not the RDMA NIC")
            _said_tcp = True
        return
    _bump(counter, nbytes)


def _ends(writer: asyncio.StreamWriter) -> tuple[str, str]:
    """(local address, peer address) of a connection."""
    sock = writer.get_extra_info("sockname") or ("",)
    peer = writer.get_extra_info("peername") or ("",)
    return str(sock[0]), str(peer[0])


async def nixl_pull(params: dict[str, Any]) -> tuple[bool, str, int]:
    """Decode side: fetch the blocks from the prefill's side channel. Returns (ok, why, bytes)."""
    remote_tp = int(params.get("tp_size") or 1)
    if STATE.tp % remote_tp != 0:
        return (
            False,
            f"Local tensor parallel size {STATE.tp} is not divisible by remote "
            f"tensor parallel size {remote_tp}",
            0,
        )
    host = str(params.get("remote_host") or "localhost")
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        host = os.environ.get("HGXSERVE_SIM_LOOPBACK") or "127.0.0.1"
    port = int(params.get("remote_port") or 0)
    timeout = env_float("HGXSERVE_SIM_HANDSHAKE_TIMEOUT", 5.0)
    ask = {
        "engine_id": params.get("remote_engine_id"),
        "block_ids": params.get("remote_block_ids") or [],
        "local_tp": STATE.tp,
    }
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(json.dumps(ask).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        ends = _ends(writer)
        writer.close()
        answer = json.loads(line or b"{}")
    except (TimeoutError, OSError, ValueError) as exc:
        return False, f"handshake_setup_failed with {host}:{port}: {exc!r}", 0
    if not answer.get("ok"):
        return False, f"remote refused transfer: {answer.get('error')}", 0
    proto_info(*ends, "remote memory read by ucp_get*(multi) into cuda/GPU0")
    rdma_count("port_rcv_data", int(answer.get("bytes", 0)), *ends)
    return True, "", int(answer.get("bytes", 0))


async def nixl_side_channel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Prefill side: hand out held blocks for (engine id, block ids), then free them."""
    try:
        ask = json.loads(await reader.readline() or b"{}")
        blocks = list(ask.get("block_ids") or [])
        held = STATE.held_blocks.get(blocks[0]) if blocks else None
        if ask.get("engine_id") != STATE.engine_id:
            answer = {
                "ok": False,
                "error": f"engine id {ask.get('engine_id')} is not {STATE.engine_id}",
            }
        elif held is None or held["block_ids"] != blocks:
            answer = {"ok": False, "error": "blocks not held (expired or unknown)"}
        else:
            STATE.held_blocks.pop(blocks[0], None)
            answer = {"ok": True, "bytes": held["bytes"], "num_descriptors": len(blocks)}
            rdma_count("port_xmit_data", held["bytes"], *_ends(writer))
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
    except (OSError, ValueError):
        pass
    finally:
        writer.close()


def hold_blocks(prompt_tokens: int) -> list[int]:
    """Prefill side: allocate and hold blocks until the decode pulls them or they expire."""
    now = time.monotonic()
    ttl = env_float("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480.0)
    for first, held in list(STATE.held_blocks.items()):
        if held["expires"] < now:
            STATE.held_blocks.pop(first, None)
            STATE.inc("nixl:kv_expired_reqs")
    n = max(1, math.ceil(prompt_tokens / STATE.block_size))
    ids = list(range(STATE.next_block, STATE.next_block + n))
    STATE.next_block += n
    STATE.held_blocks[ids[0]] = {
        "block_ids": ids,
        "expires": now + ttl,
        "bytes": n * STATE.block_size * 70272,
    }
    return ids


async def sglang_bootstrap(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Prefill side: answer a decode asking for a room's KV (waiting briefly for it)."""
    try:
        ask = json.loads(await reader.readline() or b"{}")
        room = int(ask.get("room"))
        wait = env_float("HGXSERVE_SIM_BOOTSTRAP_WAIT", 10.0)
        event = STATE.room_events.setdefault(room, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), wait)
            kv = STATE.rooms.pop(room)
            STATE.room_events.pop(room, None)
            answer = {"ok": True, "tokens": kv["tokens"], "bytes": kv["tokens"] * 70272}
            rdma_count("port_xmit_data", answer["bytes"], *_ends(writer))
        except TimeoutError:
            STATE.room_events.pop(room, None)
            answer = {"ok": False, "error": f"room {room} never prefilled here"}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
    except (OSError, ValueError, TypeError):
        pass
    finally:
        writer.close()


async def sglang_pull(body: dict[str, Any]) -> tuple[bool, str, str]:
    """Decode side: get the room's KV from the prefill's bootstrap server. (ok, why, kind)."""
    host = str(body.get("bootstrap_host"))
    if host in ("localhost", "127.0.0.1", "::1"):
        host = os.environ.get("HGXSERVE_SIM_LOOPBACK") or "127.0.0.1"
    port = int(body.get("bootstrap_port") or 8998)
    wait = env_float("HGXSERVE_SIM_BOOTSTRAP_WAIT", 10.0)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
    except (TimeoutError, OSError) as exc:
        return False, f"bootstrap {host}:{port} unreachable: {exc!r}", "bootstrap_failed_reqs"
    try:
        writer.write(json.dumps({"room": body.get("bootstrap_room")}).encode() + b"\n")
        await writer.drain()
        answer = json.loads(await asyncio.wait_for(reader.readline(), wait + 5) or b"{}")
        ends = _ends(writer)
    except (TimeoutError, OSError, ValueError) as exc:
        return False, f"transfer failed: {exc!r}", "transfer_failed_reqs"
    finally:
        writer.close()
    if not answer.get("ok"):
        return False, f"transfer failed: {answer.get('error')}", "transfer_failed_reqs"
    rdma_count("port_rcv_data", int(answer.get("bytes", 0)), *ends)
    return True, "", ""


# --------------------------------------------------------------------------- generation


async def generate(conn: Conn, body: dict[str, Any], headers: dict[str, str], chat: bool) -> None:
    s = STATE
    start = time.monotonic()
    req_id = headers.get("x-request-id") or uuid.uuid4().hex
    model = body.get("model") or s.served_names[0]
    if model not in s.served_names:
        await conn.send_json(
            404, error_body(404, f"The model `{model}` does not exist.", "NotFoundError")
        )
        return
    try:
        text = prompt_of(body, chat)
    except ValueError as exc:
        await conn.send_json(400, error_body(400, str(exc)))
        return
    if "SIM_DROP_REQUEST" in text:
        s.inc("dropped")
        s.record({"request_id": req_id, "dropped": True})
        conn.writer.transport.abort()
        raise Aborted()
    prompt_tokens = count_prompt_tokens(body, text, chat)
    other_rdma_traffic()
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is None:
        max_tokens = s.max_model_len - prompt_tokens
    max_tokens = int(max_tokens)
    if prompt_tokens + max_tokens > s.max_model_len:
        await conn.send_json(
            400,
            error_body(
                400,
                (
                    f"This model's maximum context length is {s.max_model_len} tokens. "
                    f"However, you requested {prompt_tokens + max_tokens} tokens "
                    f"({prompt_tokens} in the messages, {max_tokens} in the completion). "
                    "Please reduce the length of the messages or completion."
                ),
            ),
        )
        return
    entry: dict[str, Any] = {
        "request_id": req_id,
        "chat": chat,
        "stream": bool(body.get("stream")),
        "max_tokens": body.get("max_tokens"),
        "max_completion_tokens": body.get("max_completion_tokens"),
        "has_stream_options": "stream_options" in body,
        "has_min_tokens": "min_tokens" in body,
        "kv_transfer_params_in": body.get("kv_transfer_params"),
        "bootstrap_room": body.get("bootstrap_room"),
        "prompt_tokens": prompt_tokens,
        "ignore_eos": bool(body.get("ignore_eos")),
        "at": time.time(),
        "kv": "local",
        "aborted": False,
        "status": 200,
    }
    s.record(entry)
    s.inc("requests")
    if jit_simulated():
        bucket = 1 << max(0, prompt_tokens - 1).bit_length()
        if bucket not in s.jit_buckets:  # a shape never run before compiles its kernel
            s.jit_buckets.add(bucket)
            log(
                "[TileLang:tilelang.jit.kernel:INFO]: TileLang begins to compile kernel `main` "
                f"with `out_idx=[-1]` (simulated, prompt bucket {bucket})"
            )
    kv_in = body.get("kv_transfer_params") or {}
    nixl = s.kv.get("kv_connector") == "NixlConnector"
    prefill_time = prompt_tokens / 1000 * env_float("HGXSERVE_SIM_PREFILL_SECONDS_PER_1K", 0.02)
    prefill_time = sim_speed(prefill_time)
    remote_prefill = bool(
        nixl and kv_in.get("do_remote_prefill") and s.kv_role in ("kv_consumer", "kv_both")
    )
    remote_decode = bool(
        nixl and kv_in.get("do_remote_decode") and s.kv_role in ("kv_producer", "kv_both")
    )
    s.waiting += 1
    assert s.slots is not None
    try:
        await s.slots.acquire()
    finally:
        s.waiting -= 1
    s.running += 1
    plan: dict[str, Any] = {"cache": None}
    try:
        plan = prefix_plan(body, text, chat, prompt_tokens, headers)
        entry["cached_tokens"] = plan["cached"]
        prefill_time *= (prompt_tokens - plan["cached"]) / max(1, prompt_tokens)
        # ----- obtain the prompt's KV: remote transfer, or local compute
        if remote_prefill:
            t0 = time.monotonic()
            ok, why, nbytes = await nixl_pull(kv_in)
            if ok:
                dt = max(time.monotonic() - t0, 1e-6)
                for _ in range(s.tp):  # one transfer per local TP rank, as vLLM counts them
                    s.nixl_xfer.observe(dt)
                    s.nixl_post.observe(dt / 10)
                    s.nixl_bytes.observe(nbytes / s.tp)
                    s.nixl_desc.observe(len(kv_in.get("remote_block_ids") or []))
                s.inc("prompt_src:external_kv_transfer", prompt_tokens)
                entry["kv"] = "transferred"
            else:
                s.inc("nixl:failed_transfers")
                log(f"request {req_id}: KV transfer failed: {why}")
                entry["kv_error"] = why
                if s.failure_policy == "fail":
                    entry.update(kv="failed", status=500)
                    s.inc("finished:abort")
                    await conn.send_json(
                        500, error_body(500, f"KV load failed: {why}", "InternalServerError")
                    )
                    return
                entry["kv"] = "recomputed"
                s.inc("prompt_src:local_compute", prompt_tokens - plan["cached"])
                s.inc("prompt_src:local_cache_hit", plan["cached"])
                await sim_prefill(conn, prefill_time)
        elif s.disagg_mode == "decode":
            if body.get("bootstrap_room") is None or not body.get("bootstrap_host"):
                entry["status"] = 400
                await conn.send_json(
                    400,
                    error_body(
                        400, "decode server needs bootstrap_host, bootstrap_port, bootstrap_room"
                    ),
                )
                return
            t0 = time.monotonic()
            ok, why, kind = await sglang_pull(body)
            if not ok:
                s.inc("sgl:" + kind)
                entry.update(kv="failed", status=500, kv_error=why)
                log(f"request {req_id}: {why}")
                await conn.send_json(500, error_body(500, why, "InternalServerError"))
                return
            s.sgl_xfer_ms.observe((time.monotonic() - t0) * 1000)
            entry["kv"] = "transferred"
        else:
            s.inc("prompt_src:local_compute", prompt_tokens - plan["cached"])
            s.inc("prompt_src:local_cache_hit", plan["cached"])
            await sim_prefill(conn, prefill_time)
        prefix_store(plan)
        if s.disagg_mode == "prefill":
            room = body.get("bootstrap_room")
            if room is None:
                entry["status"] = 400
                await conn.send_json(400, error_body(400, "prefill server needs bootstrap_room"))
                return
            s.rooms[int(room)] = {"tokens": prompt_tokens}
            s.room_events.setdefault(int(room), asyncio.Event()).set()
            entry["kv"] = "held"
        s.inc("prompt_tokens", prompt_tokens)

        reasoning, answer, natural = plan_tokens(body, text, chat)
        ignore_eos = bool(body.get("ignore_eos"))
        if s.disagg_mode == "prefill":
            max_tokens = 1
        tokens: list[tuple[str, str]] = [("reasoning", t) for t in reasoning]
        tokens += [("content", t) for t in answer]
        if ignore_eos:
            filler = random.Random(text)
            while len(tokens) < max_tokens:
                tokens.append(("content", filler.choice(WORDS) + " "))
        # EOS needs a slot of its own: an answer that fills max_tokens is length-capped
        finish = natural
        if len(tokens) >= max_tokens:
            tokens, finish = tokens[:max_tokens], "length"

        kv_out: dict[str, Any] | None = None
        if remote_decode:
            entry["kv"] = "held"
            if finish == "length":
                # vLLM's request_finished returns params only for length-capped prefill requests
                kv_out = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": hold_blocks(prompt_tokens),
                    "remote_engine_id": s.engine_id,
                    "remote_host": s.side_channel_host,
                    "remote_port": s.side_channel_port + s.dp_start,
                    "tp_size": s.tp,
                }
            else:
                entry["kv"] = "first_token_eos"
        await emit(conn, body, chat, model, req_id, tokens, finish, prompt_tokens, kv_out, start)
        s.inc(f"finished:{finish}")
        s.inc("generation_tokens", len(tokens))
        s.e2e.observe(time.monotonic() - start)
    except (Aborted, ConnectionError):
        entry["aborted"] = True
        s.inc("finished:abort")
        log(f"request {req_id}: client went away, aborted")
        raise Aborted() from None
    finally:
        prefix_done(plan)
        s.running -= 1
        s.slots.release()


async def emit(
    conn: Conn,
    body: dict[str, Any],
    chat: bool,
    model: str,
    req_id: str,
    tokens: list[tuple[str, str]],
    finish: str,
    prompt_tokens: int,
    kv_out: dict[str, Any] | None,
    start: float,
) -> None:
    """Write the answer: SSE chunks as tokens are produced, or one JSON body at the end."""
    token_time = sim_speed(env_float("HGXSERVE_SIM_TOKEN_SECONDS", 0.01))
    created = int(time.time())
    rid = ("chatcmpl-" if chat else "cmpl-") + req_id
    obj = "chat.completion" if chat else "text_completion"
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + len(tokens),
        "completion_tokens": len(tokens),
        "prompt_tokens_details": None,
    }
    out_headers = {"x-request-id": req_id}
    tool_call = None
    tools = body.get("tools")
    if chat and tools and body.get("tool_choice", "auto") != "none" and finish != "length":
        choice = body.get("tool_choice")
        fn = (
            choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
        )
        args = json.dumps({"query": "".join(t for k, t in tokens if k == "content")[:40].strip()})
        tool_call = {
            "id": "chatcmpl-tool-" + req_id[:16],
            "type": "function",
            "function": {"name": fn, "arguments": args},
        }
        tokens = [t for t in tokens if t[0] == "reasoning"]
        finish = "tool_calls"
    if body.get("stream"):
        await conn.start_stream(out_headers)

        pad_to = int(env_float("HGXSERVE_SIM_EVENT_BYTES", 0))

        async def sse(payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            if len(data) < pad_to:  # (simulated large events: a field real engines never send)
                data = json.dumps({**payload, "sim_padding": "x" * (pad_to - len(data))}).encode()
            await conn.chunk(b"data: " + data + b"\n\n")

        base = {
            "id": rid,
            "object": obj + ".chunk" if chat else obj,
            "created": created,
            "model": model,
        }
        if chat:
            await sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        first = True
        first_at = prev = time.monotonic()
        gaps: list[float] = []
        for kind, tok in tokens:
            await sim_step(conn, token_time, first)
            now = time.monotonic()
            if first:
                STATE.ttft.observe(now - start)
                first = False
                first_at = now
            else:
                gaps.append(now - prev)
            prev = now
            if chat:
                delta = (
                    {"content": tok}
                    if kind == "content"
                    else {"reasoning_content": tok, "reasoning": tok}
                )
                choice_obj: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": None,
                }
            else:
                choice_obj = {
                    "index": 0,
                    "text": tok,
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            await sse({**base, "choices": [choice_obj]})
        if tool_call:
            await sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"tool_calls": [{"index": 0, **tool_call}]},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        observe_decode(first_at, gaps)
        last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        last.update({"delta": {}} if chat else {"text": "", "stop_reason": None})
        await sse({**base, "choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await sse({**base, "choices": [], "usage": usage})
        await conn.chunk(b"data: [DONE]\n\n")
        await conn.end_stream()
        return
    stamps = []
    for _ in tokens:
        await pause(conn, token_time)
        stamps.append(time.monotonic())
    if tokens:
        STATE.ttft.observe(time.monotonic() - start - token_time * (len(tokens) - 1))
        observe_decode(stamps[0], [b - a for a, b in zip(stamps, stamps[1:], strict=False)])
    reasoning_text = "".join(t for k, t in tokens if k == "reasoning") or None
    content = "".join(t for k, t in tokens if k == "content")
    if chat:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or None,
            "reasoning_content": reasoning_text,
            "reasoning": reasoning_text,
            "tool_calls": [tool_call] if tool_call else [],
        }
        choice_obj = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
    else:
        choice_obj = {
            "index": 0,
            "text": content,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    await conn.send_json(
        200,
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice_obj],
            "usage": usage,
            "kv_transfer_params": kv_out,
        },
        headers=out_headers,
    )


# --------------------------------------------------------------------------- lifecycle


def gpu_dir() -> str:
    return os.environ.get("HGXSERVE_SIM_GPU_DIR") or "/run/hgxserve-sim/gpus"


def hold_gpu_memory(fraction: float) -> None:
    """Write one memory file per visible GPU, as the fake nvidia-smi expects."""
    visible = [
        g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()
    ]
    if not visible:
        log("CUDA_VISIBLE_DEVICES is empty: holding no simulated GPU memory")
        return
    total = env_float("HGXSERVE_SIM_GPU_TOTAL_MIB", 143771)
    name = "VLLM::EngineCore" if STATE.engine == "vllm" else "sglang::scheduler"
    os.makedirs(gpu_dir(), exist_ok=True)
    for index in visible:
        path = os.path.join(gpu_dir(), f"{index}.json")
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(
                {"pid": os.getpid(), "used_mib": int(fraction * total), "process_name": name}, fh
            )
        os.replace(tmp, path)
        STATE.gpu_files.append(path)
    mib = int(fraction * total)
    log(f"holding simulated GPU memory on GPUs {','.join(visible)} ({mib} MiB each)")


def release_gpu_memory() -> None:
    for path in STATE.gpu_files:
        try:
            with open(path) as fh:
                if json.load(fh).get("pid") != os.getpid():
                    continue  # another process took this GPU since; not ours to remove
            os.remove(path)
        except (OSError, ValueError):
            pass
    STATE.gpu_files.clear()


def configure(args: dict[str, Any]) -> None:
    """Fill STATE from parsed flags."""
    s = STATE
    pos = args["_positional"]
    if s.engine == "vllm":
        s.model_path = str(args.get("--model") or (pos[0] if pos else "") or "facebook/opt-125m")
        s.tp = int(args.get("--tensor-parallel-size") or args.get("-tp") or 1)
        s.dp_size = int(args.get("--data-parallel-size") or 1)
        s.dp_local = int(args.get("--data-parallel-size-local") or s.dp_size)
        s.dp_start = int(args.get("--data-parallel-start-rank") or 0)
        s.max_num_seqs = int(args.get("--max-num-seqs") or 256)
        s.block_size = int(args.get("--block-size") or 16)
        s.reasoning_parser = args.get("--reasoning-parser")
        s.kv = args.get("--kv-transfer-config") or {}
        s.kv_role = s.kv.get("kv_role")
        s.engine_id = str(s.kv.get("engine_id") or s.engine_id)
        extra = s.kv.get("kv_connector_extra_config") or {}
        s.failure_policy = str(extra.get("kv_load_failure_policy", "recompute"))
        s.side_channel_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        if "loopback_side_channel" in STATE.fail:
            s.side_channel_host = "127.0.0.1"
        s.side_channel_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        default_port = 8000
        default_host = None
    else:
        s.model_path = str(
            args.get("--model-path") or args.get("--model") or (pos[0] if pos else "")
        )
        s.tp = int(
            args.get("--tp") or args.get("--tp-size") or args.get("--tensor-parallel-size") or 1
        )
        s.dp_size = int(args.get("--dp") or args.get("--dp-size") or 1)
        s.max_num_seqs = int(args.get("--max-running-requests") or 256)
        s.block_size = int(args.get("--page-size") or 16)  # SGLang's own default is 1
        s.reasoning_parser = args.get("--reasoning-parser")
        s.disagg_mode = str(args.get("--disaggregation-mode") or "null")
        s.bootstrap_port = int(args.get("--disaggregation-bootstrap-port") or 8998)
        flag = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower()
        s.health_generates = flag not in ("0", "false", "no", "off")
        default_port = 30000
        default_host = "127.0.0.1"
    keys = args.get("--api-key")
    if isinstance(keys, str):
        keys = [keys]
    if not keys and s.engine == "vllm" and os.environ.get("VLLM_API_KEY"):
        keys = [os.environ["VLLM_API_KEY"]]
    s.api_keys = [hashlib.sha256(k.encode()).digest() for k in keys or [] if k]
    names = args.get("--served-model-name")
    s.served_names = names if isinstance(names, list) else ([names] if names else [s.model_path])
    s.max_model_len = int(args.get("--max-model-len") or args.get("--context-length") or 8192)
    args["_port"] = int(args.get("--port") or default_port)
    args["_host"] = args.get("--host") or default_host


def start_phases(total: float, eager: bool) -> list[tuple[str, float]]:
    """The start's log lines, as the real engine prints them, and the time after each: weights
    (40%), compile (20%), CUDA graphs (40%; none with --enforce-eager / --disable-cuda-graph)."""
    shards, graphs = 8, 10
    weights = total * (0.4 if not eager else 0.7)
    compile_s = total * (0.2 if not eager else 0.3)
    capture = total - weights - compile_s
    out: list[tuple[str, float]] = []
    if STATE.engine == "sglang":
        out.append(("Load weight begin. avail mem=139.70 GB", 0.0))
    for i in range(shards + 1):
        bar = f"{100 * i // shards:3d}% Completed | {i}/{shards}"
        out.append((f"Loading safetensors checkpoint shards: {bar}", weights / (shards + 1)))
    tokens = kv_tokens()
    if STATE.engine == "vllm":
        out.append((f"Loading weights took {weights:.2f} seconds", 0.0))
        out.append(("Compiling a graph for dynamic shape takes (simulated)", compile_s))
        out.append((f"torch.compile takes {compile_s:.2f} s in total", 0.0))
        # vllm/v1/core/kv_cache_utils.py, after the KV cache is sized, before graph capture
        out.append((f"GPU KV cache size: {tokens:,} tokens", 0.0))
        length = STATE.max_model_len
        out.append(
            (f"Maximum concurrency for {length:,} tokens per request: {tokens / length:.2f}x", 0.0)
        )
    else:
        out.append(("Load weight end. type=simulated, avail mem=30.00 GB", compile_s))
        # sglang/srt/mem_cache/memory_pool.py, once the KV pool is allocated
        out.append((f"KV Cache is allocated. #tokens: {tokens}, KV size: 0.01 GB", 0.0))
    if eager:
        return out
    if STATE.engine == "vllm":
        for i in range(graphs + 1):
            pct = 100 * i // graphs
            out.append(
                (f"Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): {pct:3d}%|"
                 f" {i}/{graphs}", capture / (graphs + 1))
            )  # fmt: skip
        out.append((f"Graph capturing finished in {capture:.0f} secs, took 0.49 GiB", 0.0))
    else:
        out.append(("Capture cuda graph begin. This can take up to several minutes.", 0.0))
        for i in range(graphs + 1):
            bar = f"Capturing batches (bs={2 ** (graphs - i)} avail_mem=2.91 GB): "
            out.append((bar + f"{100 * i // graphs:3d}%| {i}/{graphs}", capture / (graphs + 1)))
        out.append((f"Capture cuda graph end. Time elapsed: {capture:.2f} s", 0.0))
    return out


def multinode_role(args: dict[str, Any]) -> tuple[str, str, int, int]:
    """(role, head host, head port, units of work) of this node of an engine: role "single",
    "head" (units: DP ranks or nodes it waits for) or "worker" (units: what it brings)."""
    if STATE.engine == "vllm":
        headless = args.get("--headless") is True
        address = str(args.get("--data-parallel-address") or "")
        port = int(args.get("--data-parallel-rpc-port") or 29550)
        if headless:
            return "worker", address, port, STATE.dp_local
        if address and STATE.dp_local < STATE.dp_size:
            return "head", address, port, STATE.dp_size - STATE.dp_local
        return "single", "", 0, 0
    nnodes = int(args.get("--nnodes") or 1)
    if nnodes <= 1:
        return "single", "", 0, 0
    host, _, port = str(args.get("--dist-init-addr") or ":").rpartition(":")
    rank = int(args.get("--node-rank") or 0)
    return (
        ("worker" if rank > 0 else "head"),
        host.strip("[]"),
        int(port or 0),
        (1 if rank > 0 else nnodes - 1),
    )


async def head_rpc(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
) -> None:
    """The head's side of one worker: `JOIN <units> <name>`, then the connection is held; its
    end after the head served is the engine's death."""
    s = STATE
    try:
        line = await asyncio.wait_for(reader.readline(), 30)
    except (TimeoutError, OSError):
        writer.close()
        return
    parts = line.decode(errors="replace").split()
    if len(parts) != 3 or parts[0] != "JOIN" or not parts[1].isdigit():
        writer.close()
        return
    name = parts[2]
    s.joined[name] = int(parts[1])
    log(f"remote engine {name} joined with {parts[1]} DP rank(s) "
        f"({sum(s.joined.values())}/{s.need_remote})")  # fmt: skip
    if s.joined_event is not None and sum(s.joined.values()) >= s.need_remote:
        s.joined_event.set()
    writer.write(b"OK\n")
    await writer.drain()
    await reader.read()  # until the worker's end
    s.joined.pop(name, None)
    writer.close()
    if s.stopping:
        return
    if s.ready:
        if s.engine == "vllm":
            # vllm/v1/engine/core_client.py and exceptions.py, as a head whose DP engine died
            log(f"ERROR Engine core proc {name} died unexpectedly, shutting down client.")
            log("ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                "issue. See stack trace (above) for the root cause.")  # fmt: skip
        else:
            # sglang/srt/entrypoints/engine.py, when a scheduler's collective peer went away
            log(f"node {name} left the process group")
            log("Received sigquit from a child process. It usually means the child failed.")
        s.engine_dead = True
        stop.set()
    else:
        log(f"remote engine {name} left before the engine was ready")


async def wait_for_workers(stop: asyncio.Event) -> bool:
    """The head: wait until the workers brought every DP rank (or node); False when stopped."""
    s = STATE
    assert s.joined_event is not None
    while sum(s.joined.values()) < s.need_remote:
        if stop.is_set():
            return False
        missing = s.need_remote - sum(s.joined.values())
        log(f"Waiting for 0 local, {missing} remote core engine proc(s) to start.")
        s.joined_event.clear()
        joined = asyncio.ensure_future(s.joined_event.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({joined, stopped}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        for task in (joined, stopped):
            task.cancel()
    return not stop.is_set()


async def join_head(host: str, port: int, units: int, stop: asyncio.Event) -> None:
    """A worker: join the head (retrying until it answers), hold the connection; when the head
    goes away, hang as a real NCCL worker does until SIGTERM."""
    name = f"{os.uname().nodename}:{os.getpid()}"
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"JOIN {units} {name}\n".encode())
            await writer.drain()
            if (await asyncio.wait_for(reader.readline(), 30)).strip() != b"OK":
                raise OSError("the head did not accept")
        except (OSError, TimeoutError) as exc:
            log(f"head {host}:{port} not reachable yet ({exc}); retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1)
            continue
        log(f"joined the head at {host}:{port} with {units} DP rank(s)")
        lost = asyncio.ensure_future(reader.read())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({lost, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (lost, stopped):
            task.cancel()
        writer.close()
        if not stop.is_set():
            log(f"lost the head at {host}:{port}; hanging in the collective as a real NCCL "
                "worker does (simulated: until SIGTERM)")  # fmt: skip
        return


async def serve(args: dict[str, Any]) -> int:
    s = STATE
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    slow = "slow_stop" in s.fail

    def on_term() -> None:
        if slow and not s.stopping:
            s.stopping = True
            delay = env_float("HGXSERVE_SIM_SLOW_STOP_SECONDS", 30)
            log(f"SIGTERM received; simulated slow_stop: ignoring it for {delay:g}s")
            loop.call_later(delay, stop.set)
            return
        s.stopping = True
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_term)
    s.slots = asyncio.Semaphore(s.max_num_seqs)
    role, head_host, head_port, units = multinode_role(args)
    rpc: asyncio.AbstractServer | None = None
    if role == "head":
        s.need_remote = units
        s.joined_event = asyncio.Event()
        try:
            rpc = await asyncio.start_server(
                lambda r, w: head_rpc(r, w, stop), "0.0.0.0", head_port
            )
        except OSError as exc:
            log(f"cannot listen on the DP RPC port {head_port}: {exc}")
            return 1
        log(f"DP coordinator (simulated) on 0.0.0.0:{head_port}, waiting for {units} remote "
            "DP rank(s)")  # fmt: skip
    start_delay = env_float("HGXSERVE_SIM_START_SECONDS", 2.0)
    log(f"loading model {s.model_path} (simulated, {start_delay:g}s)")
    eager = args.get("--enforce-eager") is True or args.get("--disable-cuda-graph") is True
    for line, seconds in start_phases(start_delay, eager):
        if line:
            log(line)
        try:
            await asyncio.wait_for(stop.wait(), seconds)
            log("stopped before ready")
            return 0
        except TimeoutError:
            pass
    if "error" in s.fail:
        return print_captured_failure(s.fail["error"])
    if "crash_on_start" in s.fail:
        log("RuntimeError: simulated engine crash on start (HGXSERVE_SIM_FAIL=crash_on_start)")
        return 1
    servers: list[asyncio.AbstractServer] = []
    fraction = float(
        args.get("--gpu-memory-utilization")
        or args.get("--mem-fraction-static")
        or (0.9 if s.engine == "vllm" else 0.88)
    )
    hold_gpu_memory(fraction)
    try:
        start_prefix_caches(args)
    except Exception as exc:  # zmq.ZMQError (address in use), ArgError: the engine fails to start
        log(f"KV events: cannot start the publisher: {exc!r}")
        release_gpu_memory()
        return 1
    try:
        if s.kv.get("kv_connector") == "NixlConnector":
            bind = s.side_channel_host
            if bind in ("localhost", "127.0.0.1"):
                bind = os.environ.get("HGXSERVE_SIM_LOOPBACK") or "127.0.0.1"
            for rank in range(s.dp_start, s.dp_start + s.dp_local):
                port = s.side_channel_port + rank
                servers.append(await asyncio.start_server(nixl_side_channel, bind, port))
                log(
                    f"NIXL side channel (simulated) listening on {bind}:{port} "
                    f"engine_id={s.engine_id} dp_rank={rank}"
                )
        if s.disagg_mode == "prefill":
            bind = args["_host"] or "0.0.0.0"
            servers.append(await asyncio.start_server(sglang_bootstrap, bind, s.bootstrap_port))
            log(f"disaggregation bootstrap server (simulated) on {bind}:{s.bootstrap_port}")
        headless = args.get("--headless") is True or int(args.get("--node-rank") or 0) > 0
        if role == "worker":
            log(f"headless: no API server; joining the head at {head_host}:{head_port}")
            await join_head(head_host, head_port, units, stop)
        elif headless:
            log("headless: no API server, holding GPUs until SIGTERM")
        elif role == "head" and not await wait_for_workers(stop):
            log("stopped before ready")
        else:
            host = args["_host"]
            servers.append(
                await asyncio.start_server(
                    handle_client, host, args["_port"], limit=1 << 22, backlog=1024
                )
            )
            s.ready = True
            log(
                f"Application startup complete. serving {s.served_names} on "
                f"http://{host or '0.0.0.0'}:{args['_port']}"
            )
            if s.engine == "sglang":
                log("The server is fired up and ready to roll!")
        await stop.wait()
    except OSError as exc:
        log(f"cannot listen: {exc}")
        release_gpu_memory()
        return 1
    log("shutting down: closing listeners")
    for srv in servers if rpc is None else [*servers, rpc]:
        srv.close()
    stop_prefix_caches()
    await asyncio.sleep(env_float("HGXSERVE_SIM_STOP_SECONDS", 1.0))
    release_gpu_memory()
    if s.engine_dead:
        log("simulated GPU memory released; exit 1 (a DP engine died)")
        return 1
    log("simulated GPU memory released; exit 0")
    return 0


FIXTURE_DIRS = (
    os.environ.get("HGXSERVE_FAKE_FIXTURES", ""),
    "/usr/local/share/hgxserve-testbed/fixtures",  # where testbed/hosts.py installs them
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakes", "fixtures"),
)


def print_captured_failure(name: str) -> int:
    """HGXSERVE_SIM_FAIL=error:NAME: print the real capture NAME.txt (without its `# source:`
    header) to stderr as the failing engine would, and exit 1."""
    for directory in filter(None, FIXTURE_DIRS):
        path = os.path.join(directory, os.path.basename(name) + ".txt")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
            log(f"simulated failure error:{name}: the real capture follows")
            for line in lines[1:] if lines and lines[0].startswith("# source:") else lines:
                print(line, file=sys.stderr, flush=True)
            return 1
    log(f"simulated failure error:{name}: no capture {name}.txt in {FIXTURE_DIRS}")
    return 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--engine" or argv[1] not in ("vllm", "sglang"):
        print("usage: simengine.py --engine vllm|sglang serve [MODEL] [flags...]", file=sys.stderr)
        return 2
    STATE.engine = argv[1]
    rest = argv[2:]
    if rest and rest[0] == "serve":
        rest = rest[1:]
    try:
        args = parse_args(rest)
    except ArgError as exc:
        print(f"{STATE.engine} serve: error: {exc}", file=sys.stderr)
        return 2
    for item in filter(None, os.environ.get("HGXSERVE_SIM_FAIL", "").split(",")):
        key, _, value = item.partition(":")
        STATE.fail[key.strip()] = value.strip()
    configure(args)
    log(f"argv: {json.dumps(sys.argv)}")
    env_keys = [
        "CUDA_VISIBLE_DEVICES",
        "VLLM_PORT",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
    ]
    env_keys += sorted(k for k in os.environ if k.startswith(("UCX_", "HGXSERVE_SIM_")))
    log("env: " + json.dumps({k: os.environ[k] for k in env_keys if k in os.environ}))
    if STATE.fail:
        log(f"failure injection: {STATE.fail}")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
