"""Recording and alerting rules rendered from a topology (Prometheus rule-file groups).

Recording rules follow Prometheus' `level:metric:operations` naming. Every selector is pinned
to the topology (`topology="<name>"`), so several topologies can share one Prometheus.

>>> [g["name"] for g in rule_groups(topo)]  # doctest: +SKIP
['hgxserve-demo-pd-inventory', 'hgxserve-demo-pd-recording', 'hgxserve-demo-pd-alerts']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hgxserve.monitoring import metrics as m
from hgxserve.monitoring.targets import (
    JOB_DCGM,
    JOB_ENGINE,
    JOB_NODE,
    JOB_PROXY,
    gpu_hosts,
    monitoring_of,
)
from hgxserve.topology.model import Monitoring, MonitoringSla, Topology

PERCENTILES = (50, 90, 95, 99)
BY_ENGINE = "topology, release, role, engine"
BY_ROLE = "topology, role"
DECODE = 'role="decode"'

# Alert runbooks: the likely cause first, from the deployment reports this tool encodes.
RUNBOOK = {
    "EngineDown": (
        "The engine's /metrics does not answer: it crashed, is restarting or never became "
        "ready. Seen causes: CUDA error 802 when Fabric Manager is missing or at another "
        "version than the driver; a NIXL handshake or UCX memlock failure at start; OOM while "
        "capturing CUDA graphs. Real engines take 4-25 min to become ready (seed 003 §12.2: "
        "about 23 min). Run `hgxserve logs TOPOLOGY ENGINE --diagnose`."
    ),
    "ProxyDown": (
        "The P/D proxy does not answer: every client request fails. Check "
        "`systemctl status hgxserve-proxy` and `hgxserve logs TOPOLOGY proxy --diagnose`."
    ),
    "ExporterDown": (
        "A node or DCGM exporter does not answer: GPU and host panels go blank for this host. "
        "DCGM needs the driver loaded (and Fabric Manager on NVSwitch hosts)."
    ),
    "EngineOutOfRotation": (
        "The proxy took this engine out of rotation (connection refused or failing health): "
        "its share of traffic goes to the others or fails. See the reason label and "
        "`hgxserve status TOPOLOGY`."
    ),
    "KVTransferFailures": (
        "KV transfers from prefill to decode fail. Seed 003 §11.3: the NIXL side channel "
        "listens on loopback (VLLM_NIXL_SIDE_CHANNEL_HOST) so the decode on another host "
        "cannot connect (handshake_setup_failed, ZMQ timeouts); or P and D disagree on TP, "
        "KV dtype or block size. With kv_load_failure_policy=recompute the decode silently "
        "recomputes the prompt: answers stay 200 but P/D gains are gone."
    ),
    "DecodeRecomputesPrompts": (
        "The decode computes prompt tokens itself instead of receiving them over KV transfer: "
        "seed 003 §11.4 - both engines busy and HTTP 200, yet no real P/D. Causes: failed "
        "KV transfers under the recompute policy, a router that does not inject "
        "kv_transfer_params, or prefills answering without KV."
    ),
    "KVCacheNearFull": (
        "The engine's KV cache is nearly full: new requests wait and running ones get "
        "preempted, so TTFT and TPOT climb. Seed 003 §8.3: GPU memory already close to the "
        "card's capacity; lower max_num_seqs / max_model_len or add decode capacity (seed 001: "
        "a second decode node doubles the KV cache space)."
    ),
    "RequestsWaitingGPUsIdle": (
        "Requests wait while the engine's GPUs do nothing: the engine is stuck, not busy. "
        "Seed 003 §8.2: a JIT kernel compile after /health was green (TileLang, 9 s per "
        "kernel; warm-up did not cover this shape); a decode waiting for KV that never "
        "arrives (side channel unreachable); a hung collective. Check the engine log for "
        "compile lines (`hgxserve cache scan`)."
    ),
    "TTFTAboveSLA": (
        "Time to first token is above the SLA. Seed 001: prefill throughput too low, so "
        "requests queue and TTFT climbs; seed 003 §8.2: JIT compiles after ready pushed p95 "
        "TTFT to 33 s on the first real load (warm up the real shapes). Compare prefill "
        "tok/s/GPU with the bench figure (seed 000: >= 2000)."
    ),
    "TPOTAboveSLA": (
        "Time per output token is above the SLA (seeds 000/001 target 40 ms): decode batches "
        "too large for the GPUs, KV cache pressure causing preemption, or decode GPUs shared "
        "with prefill work."
    ),
    "Proxy5xxRate": (
        "The proxy answers 5xx: engines fail requests (KV load failure with "
        "kv_load_failure_policy=fail answers 500), every instance of a role is out of "
        "rotation, or upstreams time out. See hgxserve_proxy_upstream_errors_total by "
        "instance."
    ),
    "GPUXidError": (
        "The GPU reported an XID error (the label value is the XID): 79 fell off the bus, "
        "48/94/95 uncorrectable ECC, 119/120 GSP errors. The engine on this GPU is likely "
        "dead or producing garbage; drain the host, then check the driver, Fabric Manager "
        "(CUDA error 802) and `nvidia-smi -q`."
    ),
    "GPUEccUncorrectable": (
        "Uncorrectable (double-bit) ECC errors or a failed row remap: results from this GPU "
        "cannot be trusted (silent corruption has produced garbage output in vLLM and SGLang "
        "reports). Drain the host and reset or replace the GPU."
    ),
    "GPUThermal": (
        "The GPU is hot or being throttled for temperature: clocks drop and TPOT rises "
        "unevenly across ranks. Check cooling, fan and inlet temperatures."
    ),
}


def _window(mon: Monitoring) -> str:
    """The rate() window: at least 4 scrapes (so a missed scrape does not blank it), 1 m min."""
    return f"{max(60, 4 * mon.scrape_interval_s)}s"


def _sel(topo: Topology, metric: str, extra: str = "") -> str:
    """`metric{topology="<name>",extra}`; a metric already carrying a selector is merged."""
    name, brace, rest = metric.partition("{")
    inner = f'topology="{topo.name}"'
    if brace:
        inner += "," + rest.rstrip("}")
    if extra:
        inner += "," + extra
    return f"{name}{{{inner}}}"


def _kinds(topo: Topology) -> list[m.EngineMetrics]:
    kinds = sorted({e.engine for e in topo.engines.values()})
    return [m.ENGINE_METRICS[k] for k in kinds]


def _either(parts: list[str]) -> str:
    return " or ".join(parts) if len(parts) == 1 else " or ".join(f"({p})" for p in parts)


def _record(name: str, expr: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"record": name, "expr": expr}
    if labels:
        rule["labels"] = labels
    return rule


def _engine_sum(topo: Topology, attr: str, func: str, w: str) -> str:
    parts = []
    for kind in _kinds(topo):
        metric = getattr(kind, attr)
        inner = f"{func}({_sel(topo, metric)}[{w}])" if func else _sel(topo, metric)
        parts.append(f"sum by ({BY_ENGINE}) ({inner})")
    return _either(parts)


def _quantile(topo: Topology, attr: str, q: int, w: str) -> str:
    names = sorted({getattr(k, attr) for k in _kinds(topo)})
    rates = " or ".join(f"rate({_sel(topo, n + '_bucket')}[{w}])" for n in names)
    return f"histogram_quantile({q / 100:g}, sum by ({BY_ROLE}, le) ({rates}))"


def inventory_rules(topo: Topology) -> list[dict[str, Any]]:
    """Constant series from the topology: each engine's GPU count, and which engine holds
    which GPU (host, gpu index as DCGM labels it)."""
    rules = []
    for engine in topo.engines.values():
        labels = {"topology": topo.name, "role": engine.role, "engine": engine.name}
        rules.append(_record("engine:hgxserve_gpus:count", f"vector({engine.gpu_count})", labels))
    for engine in topo.engines.values():
        for host, gpus in engine.place.items():
            for gpu in gpus:
                labels = {
                    "topology": topo.name,
                    "role": engine.role,
                    "engine": engine.name,
                    "host": host,
                    "gpu": str(gpu),
                }
                rules.append(_record("gpu:hgxserve_engine:info", "vector(1)", labels))
    return rules


def recording_rules(topo: Topology) -> list[dict[str, Any]]:
    mon = monitoring_of(topo)
    w = _window(mon)
    kinds = _kinds(topo)
    rules = [
        _record(
            "engine:hgxserve_prompt_tokens:rate", _engine_sum(topo, "prompt_tokens", "rate", w)
        ),
        _record(
            "engine:hgxserve_generation_tokens:rate",
            _engine_sum(topo, "generation_tokens", "rate", w),
        ),
        _record(
            "role:hgxserve_prompt_tokens:rate",
            f'sum by ({BY_ROLE}) (engine:hgxserve_prompt_tokens:rate{{topology="{topo.name}"}})',
        ),
        _record(
            "role:hgxserve_generation_tokens:rate",
            f"sum by ({BY_ROLE}) "
            f'(engine:hgxserve_generation_tokens:rate{{topology="{topo.name}"}})',
        ),
        _record(
            "role:hgxserve_gpus:count",
            f'sum by ({BY_ROLE}) (engine:hgxserve_gpus:count{{topology="{topo.name}"}})',
        ),
        _record(
            "role:hgxserve_prompt_tokens_per_gpu:rate",
            f'role:hgxserve_prompt_tokens:rate{{topology="{topo.name}"}} / on ({BY_ROLE}) '
            f'role:hgxserve_gpus:count{{topology="{topo.name}"}}',
        ),
        _record(
            "role:hgxserve_generation_tokens_per_gpu:rate",
            f'role:hgxserve_generation_tokens:rate{{topology="{topo.name}"}} / on ({BY_ROLE}) '
            f'role:hgxserve_gpus:count{{topology="{topo.name}"}}',
        ),
    ]
    for metric, attr in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl")):
        for q in PERCENTILES:
            rules.append(
                _record(f"role:hgxserve_{metric}_seconds:p{q}", _quantile(topo, attr, q, w))
            )
    usage = _either([f"max by ({BY_ENGINE}) ({_sel(topo, k.kv_cache_usage)})" for k in kinds])
    rules += [
        _record("engine:hgxserve_kv_cache_usage:ratio", usage),
        _record("engine:hgxserve_requests_waiting:sum", _engine_sum(topo, "waiting", "", w)),
        _record("engine:hgxserve_requests_running:sum", _engine_sum(topo, "running", "", w)),
    ]
    rules += _kv_rules(topo, w)
    if mon.dcgm_exporter and gpu_hosts(topo):
        rules.append(
            _record(
                "engine:hgxserve_gpu_util:avg",
                f"avg by (topology, role, engine) ({_sel(topo, m.GPU_UTIL)} "
                f"* on (topology, host, gpu) group_left (role, engine) "
                f'gpu:hgxserve_engine:info{{topology="{topo.name}"}})',
            )
        )
    if topo.proxy is not None:
        rules += _proxy_rules(topo, w)
    return rules


def _kv_rules(topo: Topology, w: str) -> list[dict[str, Any]]:
    kv_kinds = sorted({e.engine for e in topo.engines.values() if e.kv is not None})
    if not kv_kinds:
        return []
    kinds = [m.ENGINE_METRICS[k] for k in kv_kinds]
    failures = []
    for kind in kinds:
        terms = " + ".join(f"increase({_sel(topo, c)}[{w}])" for c in kind.kv_failures)
        failures.append(f"sum by ({BY_ENGINE}) ({terms})")
    rules = [_record("engine:hgxserve_kv_transfer_failures:increase", _either(failures))]
    for name, counters, extra in (
        ("engine:hgxserve_kv_transfers:rate", [k.kv_transfers for k in kinds], ""),
        ("engine:hgxserve_kv_transfer_bytes:rate", [k.kv_bytes for k in kinds], ""),
        (
            "engine:hgxserve_decode_recomputed_prompt_tokens:rate",
            [k.recomputed_prompt for k in kinds],
            DECODE,
        ),
    ):
        rates = [f"sum by ({BY_ENGINE}) (rate({_sel(topo, c, extra)}[{w}]))" for c in counters if c]
        if rates:
            rules.append(_record(name, _either(rates)))
    return rules


def _proxy_rules(topo: Topology, w: str) -> list[dict[str, Any]]:
    requests = _sel(topo, m.PROXY_REQUESTS)
    fivexx = _sel(topo, m.PROXY_REQUESTS, 'code="5xx"')
    total = f"sum by (topology) (rate({requests}[{w}]))"
    return [
        _record(
            "route:hgxserve_proxy_requests:rate",
            f"sum by (topology, route, code) (rate({requests}[{w}]))",
        ),
        # no 5xx answered yet: 0, not an empty result
        _record(
            "topology:hgxserve_proxy_5xx:ratio",
            f"(sum by (topology) (rate({fivexx}[{w}])) or {total} * 0) / {total}",
        ),
        _record(
            "instance:hgxserve_proxy_upstream_errors:rate",
            f"sum by (topology, exported_role, exported_instance, kind) "
            f"(rate({_sel(topo, m.PROXY_UPSTREAM_ERRORS)}[{w}]))",
        ),
        _record(
            "topology:hgxserve_proxy_kv_handoffs:rate",
            f"sum by (topology, result) (rate({_sel(topo, m.PROXY_KV_HANDOFFS)}[{w}]))",
        ),
    ]


def alert_sla(topo: Topology) -> MonitoringSla:
    """The SLA the alerts check: `monitoring.sla` keys, else the strictest bench scenario's."""
    mon = monitoring_of(topo)
    ttft, tpot = mon.sla.ttft_s, mon.sla.tpot_ms
    percentile = mon.sla.percentile
    bench = topo.raw.get("bench") or {}
    scenario_slas = [s.get("sla") or {} for s in bench.get("scenarios", [])]
    if ttft is None:
        found = [s["ttft_s"] for s in scenario_slas if "ttft_s" in s]
        ttft = min(found) if found else None
    if tpot is None:
        found = [s["tpot_ms"] for s in scenario_slas if "tpot_ms" in s]
        tpot = min(found) if found else None
    if "percentile" not in (topo.raw.get("monitoring") or {}).get("sla", {}):
        found_p = [s["percentile"] for s in scenario_slas if "percentile" in s]
        percentile = max(found_p) if found_p else percentile
    return MonitoringSla(
        percentile=percentile, ttft_s=ttft, tpot_ms=tpot, error_rate=mon.sla.error_rate
    )


@dataclass(frozen=True)
class _Alert:
    """One alerting rule; its runbook entry is the one named like it."""

    name: str
    expr: str
    for_s: int
    severity: str
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": f"Hgxserve{self.name}", "expr": self.expr}
        if self.for_s:
            rule["for"] = f"{self.for_s}s"
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook": RUNBOOK[self.name],
        }
        return rule


def alert_rules(topo: Topology) -> list[dict[str, Any]]:
    mon = monitoring_of(topo)
    w = _window(mon)
    t = f'topology="{topo.name}"'
    f = mon.alert_for_s
    down = f'up{{job="{JOB_ENGINE}",{t}}} == 0'
    if mon.node_exporter:
        # a unit still activating is an engine starting (seed 003 §12.2: ~23 min), not down;
        # systemd fails it after its TimeoutStartSec= and then it counts as down
        starting = _sel(topo, m.NODE_UNIT_STATE, f'state="activating",name=~"{m.UNIT_INCLUDE}"')
        down += (
            f' unless on (topology, host, engine) label_replace({starting} == 1, "engine", '
            f'"$1", "name", "{m.UNIT_ENGINE}")'
        )
    rules = [
        _Alert(
            "EngineDown",
            down,
            f,
            "critical",
            "{{ $labels.role }} engine {{ $labels.engine }} on {{ $labels.host }} is down",
            "Prometheus cannot scrape {{ $labels.instance }} (GPUs {{ $labels.gpus }}).",
        ).rule()
    ]
    if topo.proxy is not None:
        rules += [
            _Alert(
                "ProxyDown",
                f'up{{job="{JOB_PROXY}",{t}}} == 0',
                f,
                "critical",
                "The proxy of {{ $labels.topology }} on {{ $labels.host }} is down",
                "Prometheus cannot scrape {{ $labels.instance }}.",
            ).rule(),
            _Alert(
                "EngineOutOfRotation",
                f"{_sel(topo, m.PROXY_INSTANCE_HEALTHY)} == 0",
                f,
                "warning",
                "The proxy has {{ $labels.exported_role }} {{ $labels.exported_instance }} "
                "out of rotation",
                f"Out of rotation for {f} s or longer.",
            ).rule(),
            _Alert(
                "Proxy5xxRate",
                f"topology:hgxserve_proxy_5xx:ratio{{{t}}} > {mon.sla.error_rate:g}",
                f,
                "critical",
                "{{ $value | humanizePercentage }} of proxy answers are 5xx",
                f"More than {mon.sla.error_rate:g} of answers failed over {w}.",
            ).rule(),
        ]
    exporters = [
        j for j, on in ((JOB_NODE, mon.node_exporter), (JOB_DCGM, mon.dcgm_exporter)) if on
    ]
    if exporters:
        rules.append(
            _Alert(
                "ExporterDown",
                f'up{{job=~"{"|".join(exporters)}",{t}}} == 0',
                f,
                "warning",
                "{{ $labels.job }} on {{ $labels.host }} is down",
                "Prometheus cannot scrape {{ $labels.instance }}.",
            ).rule()
        )
    rules += _kv_alerts(topo, f)
    rules.append(
        _Alert(
            "KVCacheNearFull",
            f"engine:hgxserve_kv_cache_usage:ratio{{{t}}} > {mon.kv_cache_full:g}",
            f,
            "warning",
            "KV cache of {{ $labels.engine }} is {{ $value | humanizePercentage }} full",
            f"Above {mon.kv_cache_full:g} for {f} s.",
        ).rule()
    )
    if mon.dcgm_exporter and gpu_hosts(topo):
        rules.append(
            _Alert(
                "RequestsWaitingGPUsIdle",
                f"engine:hgxserve_requests_waiting:sum{{{t}}} > 0 and on (topology, engine) "
                f"engine:hgxserve_gpu_util:avg{{{t}}} < {mon.gpu_idle_util:g}",
                f,
                "critical",
                "Requests wait on {{ $labels.engine }} while its GPUs are idle",
                f"Waiting requests and GPU utilisation below {mon.gpu_idle_util:g}% for {f} s.",
            ).rule()
        )
        rules += _gpu_alerts(topo, mon, w)
    rules += _sla_alerts(topo, f)
    return rules


def _kv_alerts(topo: Topology, f: int) -> list[dict[str, Any]]:
    t = f'topology="{topo.name}"'
    out = []
    if any(e.kv is not None for e in topo.engines.values()):
        out.append(
            _Alert(
                "KVTransferFailures",
                f"engine:hgxserve_kv_transfer_failures:increase{{{t}}} > 0",
                0,
                "critical",
                "KV transfers fail on {{ $labels.engine }}",
                "{{ $value }} failed KV transfers in the last window.",
            ).rule()
        )
    if any(
        e.kv is not None and e.engine == "vllm" and e.role == "decode"
        for e in topo.engines.values()
    ):
        out.append(
            _Alert(
                "DecodeRecomputesPrompts",
                f"engine:hgxserve_decode_recomputed_prompt_tokens:rate{{{t}}} > 0",
                f,
                "warning",
                "Decode {{ $labels.engine }} computes prompts itself ({{ $value }} tok/s)",
                "Prompt tokens of source local_compute on a decode engine.",
            ).rule()
        )
    return out


def _gpu_alerts(topo: Topology, mon: Monitoring, w: str) -> list[dict[str, Any]]:
    return [
        _Alert(
            "GPUXidError",
            f"{_sel(topo, m.GPU_XID)} > 0",
            0,
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.host }} reported XID {{ $value }}",
            "DCGM_FI_DEV_XID_ERRORS holds the last XID the GPU reported.",
        ).rule(),
        _Alert(
            "GPUEccUncorrectable",
            f"increase({_sel(topo, m.GPU_ECC_DBE)}[{w}]) > 0 "
            f"or {_sel(topo, m.GPU_ROW_REMAP_FAILURE)} > 0",
            0,
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.host }} has uncorrectable memory errors",
            "Double-bit volatile ECC errors grew or a row remap failed.",
        ).rule(),
        _Alert(
            "GPUThermal",
            f"{_sel(topo, m.GPU_TEMP)} > {mon.gpu_temp_c} "
            f"or increase({_sel(topo, m.GPU_THERMAL_VIOLATION)}[{w}]) > 0",
            mon.alert_for_s,
            "warning",
            "GPU {{ $labels.gpu }} on {{ $labels.host }} is hot or thermally throttled",
            f"Above {mon.gpu_temp_c} C or throttled for temperature.",
        ).rule(),
    ]


def _sla_alerts(topo: Topology, f: int) -> list[dict[str, Any]]:
    sla = alert_sla(topo)
    t = f'topology="{topo.name}"'
    p = sla.percentile
    q = p
    out = []
    if sla.ttft_s is not None:
        # the prompt's compute is the TTFT: on prefill engines in P/D, on combined ones
        out.append(
            _Alert(
                "TTFTAboveSLA",
                f'role:hgxserve_ttft_seconds:p{q}{{{t},role=~"prefill|combined"}} > {sla.ttft_s:g}',
                f,
                "critical",
                f"P{q} TTFT of {{{{ $labels.role }}}} is {{{{ $value | humanizeDuration }}}}",
                f"Above the SLA of {sla.ttft_s:g} s (P{p}).",
            ).rule()
        )
    if sla.tpot_ms is not None:
        out.append(
            _Alert(
                "TPOTAboveSLA",
                f'role:hgxserve_tpot_seconds:p{q}{{{t},role=~"decode|combined"}} > '
                f"{sla.tpot_ms / 1000:g}",
                f,
                "critical",
                f"P{q} TPOT of {{{{ $labels.role }}}} is {{{{ $value | humanizeDuration }}}}",
                f"Above the SLA of {sla.tpot_ms:g} ms (P{p}).",
            ).rule()
        )
    return out


def rule_groups(topo: Topology) -> list[dict[str, Any]]:
    mon = monitoring_of(topo)
    interval = f"{mon.evaluation_interval_s}s"
    prefix = f"hgxserve-{topo.name}"
    return [
        {"name": f"{prefix}-inventory", "interval": interval, "rules": inventory_rules(topo)},
        {"name": f"{prefix}-recording", "interval": interval, "rules": recording_rules(topo)},
        {"name": f"{prefix}-alerts", "interval": interval, "rules": alert_rules(topo)},
    ]
