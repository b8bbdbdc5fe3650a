"""The Grafana dashboard of a topology: the seeds' views (seed 000 §6, seed 003 §8.3, §13).

Throughput per role over time, TTFT/TPOT/ITL P50/P90/P99, tok/s/GPU (prefill and output), KV
cache usage and queue depth, KV transfer rate and failures, proxy routes and 5xx, and GPU
utilisation / memory / power / SM activity / NVLink per GPU. Queries read the recording rules
(hgxserve.monitoring.rules) and DCGM's fields, filtered by the `$topology` variable; the
datasource is a `$datasource` variable, so the JSON provisions into any Grafana.

>>> dashboard(topo)["uid"]  # doctest: +SKIP
'hgxserve-demo-pd'
"""

from __future__ import annotations

from typing import Any

from hgxserve.monitoring import metrics as m
from hgxserve.monitoring.targets import gpu_hosts, monitoring_of
from hgxserve.topology.model import Topology

T = 'topology="$topology"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(
    title: str, targets: list[tuple[str, str]], unit: str, description: str = ""
) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _each(record: str) -> list[tuple[str, str]]:
    """One line per series of a recording rule, named by the label the rule sums by (its first
    part: `role:...` draws one line per role)."""
    label = record.split(":", 1)[0]
    return [(f"{record}{{{T}}}", f"{{{{{label}}}}}")]


def _percentiles(metric: str) -> list[tuple[str, str]]:
    return [
        (f"role:hgxserve_{metric}_seconds:p{q}{{{T}}}", f"{{{{role}}}} P{q}") for q in (50, 90, 99)
    ]


def panels(topo: Topology) -> list[dict[str, Any]]:
    """Rows and panels, only for what this topology has (no KV row without P/D)."""
    mon = monitoring_of(topo)
    out: list[dict[str, Any]] = [_row("Throughput")]
    out += [
        _panel(
            "Output tokens/s per role",
            _each("role:hgxserve_generation_tokens:rate"),
            "short",
            "Generated tokens per second, summed over the role's engines.",
        ),
        _panel(
            "Prompt tokens/s per role",
            _each("role:hgxserve_prompt_tokens:rate"),
            "short",
        ),
        _panel(
            "Output tok/s per GPU",
            _each("role:hgxserve_generation_tokens_per_gpu:rate"),
            "short",
        ),
        _panel(
            "Prefill tok/s per GPU",
            [
                (
                    f'role:hgxserve_prompt_tokens_per_gpu:rate{{{T},role=~"prefill|combined"}}',
                    "{{role}}",
                )
            ],
            "short",
            "Prompt tokens per second per GPU of the engines that compute prompts "
            "(seed 000 SLA: >= 2000 on prefill).",
        ),
        _row("Latency"),
        _panel("TTFT P50 / P90 / P99", _percentiles("ttft"), "s", "Time to first token."),
        _panel("TPOT P50 / P90 / P99", _percentiles("tpot"), "s", "Time per output token."),
        _panel("ITL P50 / P90 / P99", _percentiles("itl"), "s", "Inter-token latency."),
        _row("Engines"),
        _panel(
            "KV cache usage",
            _each("engine:hgxserve_kv_cache_usage:ratio"),
            "percentunit",
        ),
        _panel(
            "Requests waiting / running",
            [
                (f"engine:hgxserve_requests_waiting:sum{{{T}}}", "{{engine}} waiting"),
                (f"engine:hgxserve_requests_running:sum{{{T}}}", "{{engine}} running"),
            ],
            "short",
        ),
        _panel(
            "Engines up",
            [(f'up{{{T},job="hgxserve-engine"}}', "{{engine}} ({{host}})")],
            "short",
        ),
    ]
    kv = [e for e in topo.engines.values() if e.kv is not None]
    if kv:
        out.append(_row("KV transfer (P/D)"))
        if any(e.engine == "vllm" for e in kv):
            out += [
                _panel(
                    "KV transfers/s",
                    _each("engine:hgxserve_kv_transfers:rate"),
                    "short",
                    "NIXL transfers per second (one per TP rank and request).",
                ),
                _panel(
                    "KV bytes/s",
                    _each("engine:hgxserve_kv_transfer_bytes:rate"),
                    "Bps",
                ),
            ]
        out.append(
            _panel(
                "KV transfer failures",
                _each("engine:hgxserve_kv_transfer_failures:increase"),
                "short",
                "Failed KV transfers in the last window; anything above 0 is an alert.",
            )
        )
        if any(e.engine == "vllm" and e.role == "decode" for e in kv):
            out.append(
                _panel(
                    "Decode prompt tokens computed locally",
                    _each("engine:hgxserve_decode_recomputed_prompt_tokens:rate"),
                    "short",
                    "A decode that computes prompts itself is not doing P/D (seed 003 §11.4).",
                )
            )
    if topo.proxy is not None:
        out.append(_row("Proxy"))
        out += [
            _panel(
                "Proxy requests/s by route and status",
                [(f"route:hgxserve_proxy_requests:rate{{{T}}}", "{{route}} {{code}}")],
                "reqps",
            ),
            _panel(
                "Proxy 5xx ratio",
                [(f"topology:hgxserve_proxy_5xx:ratio{{{T}}}", "5xx")],
                "percentunit",
            ),
        ]
        if kv:
            out.append(
                _panel(
                    "P/D KV hand-offs/s by result",
                    [(f"topology:hgxserve_proxy_kv_handoffs:rate{{{T}}}", "{{result}}")],
                    "reqps",
                )
            )
    if mon.dcgm_exporter and gpu_hosts(topo):
        gpu = "{{host}} GPU {{gpu}}"
        out.append(_row("GPUs (DCGM)"))
        out += [
            _panel("GPU utilisation", [(f"{m.GPU_UTIL}{{{T}}}", gpu)], "percent"),
            _panel("GPU memory used", [(f"{m.GPU_FB_USED}{{{T}}}", gpu)], "decmbytes"),
            _panel("GPU power", [(f"{m.GPU_POWER}{{{T}}}", gpu)], "watt"),
            _panel(
                "SM activity",
                [(f"{m.GPU_SM_ACTIVE}{{{T}}}", gpu)],
                "percentunit",
                "Seed 000 §6: prefill GPUs reach about 50% SM activity.",
            ),
            _panel(
                "NVLink TX / RX",
                [
                    (f"rate({m.GPU_NVLINK_TX}{{{T}}}[5m])", f"{gpu} tx"),
                    (f"rate({m.GPU_NVLINK_RX}{{{T}}}[5m])", f"{gpu} rx"),
                ],
                "Bps",
                "Seed 000 §6: NVLink RX/TX reach about 30 GB/s under P/D load.",
            ),
            _panel(
                "Engine GPU utilisation",
                _each("engine:hgxserve_gpu_util:avg"),
                "percent",
            ),
        ]
    return _layout(out)


def _layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Grid positions: rows full width, panels two per line; ids in order."""
    y = x = 0
    for pid, item in enumerate(items, start=1):
        item["id"] = pid
        if item["type"] == "row":
            if x:
                y += 8
                x = 0
            item["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
            continue
        item["gridPos"] = {"h": 8, "w": 12, "x": x, "y": y}
        x += 12
        if x >= 24:
            x = 0
            y += 8
    return items


def dashboard(topo: Topology) -> dict[str, Any]:
    """The dashboard JSON (Grafana schema 39), ready for file provisioning."""
    return {
        "uid": f"hgxserve-{topo.name}"[:40],
        "title": f"hgxserve {topo.name}",
        "description": f"Serving {topo.model.served_name}: {topo.description}".strip(": "),
        "tags": ["hgxserve", "llm-serving"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "topology",
                    "label": "Topology",
                    "type": "constant",
                    "query": topo.name,
                    "hide": 2,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels(topo),
    }


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard (what a test runs against Prometheus)."""
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
