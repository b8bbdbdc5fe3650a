"""A run's report (report.md + PNG plots) and `bench compare` (runs side by side, deltas).

Plots follow the seeds' figures 3.1-3.3 (throughput, TTFT and TPOT against concurrency or
request rate, one line per scenario) and add, per scenario, the figures topologies are chosen
by: output tok/s per GPU against tok/s per user with the Pareto front of the valid points and
the SLA region shaded (`pareto-<scenario>.png`), and TTFT / TPOT at the SLA's statistic against
the load with the SLA line (`latency-<scenario>.png`). `plots.json` holds the data behind every
figure. `bench compare --plots DIR` draws the same per-scenario figures for several runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# (figure key in a load point, axis label, file name)
PLOTS = (
    ("output_tok_s_per_gpu", "output tokens/s per GPU", "throughput.png"),
    ("ttft_ms_p90", "TTFT p90 (ms)", "ttft.png"),
    ("tpot_ms_p90", "TPOT p90 (ms)", "tpot.png"),
)
# Figures a comparison shows, with whether higher is better.
COMPARED = (
    ("request_throughput", "req/s", True),
    ("output_tok_s_per_gpu", "out tok/s/GPU", True),
    ("ttft_ms_p50", "TTFT p50 ms", False),
    ("ttft_ms_p90", "TTFT p90 ms", False),
    ("tpot_ms_p50", "TPOT p50 ms", False),
    ("tpot_ms_p90", "TPOT p90 ms", False),
)
PLOT_DATA = "plots.json"


def figure(point: dict[str, Any], key: str) -> float | None:
    """A figure of a load point, from the client figures or the per-GPU ones."""
    for part in ("client", "per_gpu"):
        value = point.get(part, {}).get(key)
        if value is not None:
            return float(value)
    return None


def _stat_key(name: str, statistic: str) -> str:
    return f"{name}_{'avg' if statistic == 'mean' else statistic}"


def _sla_of(scenario: dict[str, Any]) -> dict[str, Any]:
    sla = dict(scenario.get("sla") or {})
    pct = sla.get("percentile") or 90
    base = sla.get("statistic") or f"p{pct}"
    sla["ttft_statistic"] = sla.get("ttft_statistic") or base
    sla["tpot_statistic"] = sla.get("tpot_statistic") or base
    return sla


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (higher is better on both), by x."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def _verdict(point: dict[str, Any]) -> str:
    if not point.get("valid", True):
        return "INVALID"
    return "FAIL" if any(not v["ok"] for v in point.get("verdicts", [])) else "PASS"


def scenario_figures(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The data of every per-scenario figure: `pareto-<s>.png` (x tok/s/user, y output
    tok/s/GPU, one series per run, the front over the valid points of every run, the SLA
    region: x >= 1000 / TPOT target, y >= output tok/s/GPU target) and `latency-<s>.png`
    (TTFT and TPOT at the SLA's statistic against the load, the SLA lines)."""
    out: dict[str, dict[str, Any]] = {}
    names: list[str] = []
    slas: dict[str, dict[str, Any]] = {}
    for _, result in runs:
        for s in result["scenarios"]:
            if s["name"] not in names:
                names.append(s["name"])
                slas[s["name"]] = _sla_of(s)
    for name in names:
        sla = slas[name]
        pareto_series, latency_series, valid_xy = [], [], []
        for label, result in runs:
            pts = [p for p in result["points"] if p["scenario"] == name]
            rows = []
            for p in pts:
                x, y = figure(p, "output_tok_s_per_user"), figure(p, "output_tok_s_per_gpu")
                rows.append({"load": p["label"], "x": x, "y": y, "verdict": _verdict(p)})
                if x is not None and y is not None and _verdict(p) != "INVALID":
                    valid_xy.append((x, y))
            pareto_series.append({"run": label, "points": rows})
            latency_series.append(
                {
                    "run": label,
                    "x": [p["x"] for p in pts],
                    "ttft_ms": [
                        figure(p, _stat_key("ttft_ms", sla["ttft_statistic"])) for p in pts
                    ],
                    "tpot_ms": [
                        figure(p, _stat_key("tpot_ms", sla["tpot_statistic"])) for p in pts
                    ],
                    "verdicts": [_verdict(p) for p in pts],
                }
            )
        tpot, gpu = sla.get("tpot_ms"), sla.get("output_tok_s_per_gpu")
        out[f"pareto-{name}.png"] = {
            "scenario": name,
            "series": pareto_series,
            "front": pareto_front(valid_xy),
            "sla_region": {"x_min": 1000 / tpot if tpot else None, "y_min": gpu},
        }
        ttft = sla.get("ttft_s")
        rate = any(p.get("rate") for _, r in runs for p in r["points"] if p["scenario"] == name)
        out[f"latency-{name}.png"] = {
            "scenario": name,
            "x_axis": "request rate (req/s)" if rate else "concurrency",
            "ttft_statistic": sla["ttft_statistic"],
            "tpot_statistic": sla["tpot_statistic"],
            "series": latency_series,
            "sla": {"ttft_ms": ttft * 1000 if ttft else None, "tpot_ms": tpot},
        }
    return out


def _draw_pareto(plt: Any, data: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    for series in data["series"]:
        rows = [r for r in series["points"] if r["x"] is not None and r["y"] is not None]
        ok = [r for r in rows if r["verdict"] != "INVALID"]
        bad = [r for r in rows if r["verdict"] == "INVALID"]
        line = ax.plot([r["x"] for r in ok], [r["y"] for r in ok], "o", label=series["run"])
        if bad:
            ax.plot([r["x"] for r in bad], [r["y"] for r in bad], "x",
                    color=line[0].get_color(), label=f"{series['run']} (INVALID)")  # fmt: skip
        for r in rows:
            ax.annotate(r["load"], (r["x"], r["y"]), fontsize=7, alpha=0.7)
    front = data["front"]
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], "-", color="black",
                alpha=0.6, label="Pareto front")  # fmt: skip
    region = data["sla_region"]
    if region["x_min"] is not None or region["y_min"] is not None:
        ax.autoscale()
        x0, x1 = ax.get_xlim()
        y0, y1 = ax.get_ylim()
        left = region["x_min"] if region["x_min"] is not None else x0
        bottom = region["y_min"] if region["y_min"] is not None else y0
        ax.axvspan(left, max(x1, left), ymin=(bottom - y0) / ((y1 - y0) or 1), color="green",
                   alpha=0.12, label="SLA met")  # fmt: skip
        ax.set_xlim(x0, max(x1, left * 1.05))
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{data['scenario']}: throughput per GPU vs per user")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _draw_latency(plt: Any, data: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.0), dpi=100)
    for ax, key, stat in (
        (axes[0], "ttft_ms", data["ttft_statistic"]),
        (axes[1], "tpot_ms", data["tpot_statistic"]),
    ):
        for series in data["series"]:
            pairs = [(x, y) for x, y in zip(series["x"], series[key], strict=True) if y is not None]
            if pairs:
                ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o",
                        label=series["run"])  # fmt: skip
        target = data["sla"][key]
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", label=f"SLA {target:g} ms")
        ax.set_xlabel(data["x_axis"])
        ax.set_ylabel(f"{key.split('_')[0].upper()} {stat} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['scenario']}: latency at the SLA's statistic")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_scenario_figures(runs: list[tuple[str, dict[str, Any]]], out_dir: Path) -> list[Path]:
    """Write the per-scenario figures of `runs` and their data (plots.json) into out_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = scenario_figures(runs)
    written = []
    for name, fig_data in data.items():
        path = out_dir / name
        if name.startswith("pareto-"):
            _draw_pareto(plt, fig_data, path)
        else:
            _draw_latency(plt, fig_data, path)
        written.append(path)
    (out_dir / PLOT_DATA).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return written


def plot_run(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write one PNG per figure; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    scenarios = [s["name"] for s in result["scenarios"]]
    for key, label, name in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for scenario in scenarios:
            points = [p for p in result["points"] if p["scenario"] == scenario]
            pairs = [(p["x"], figure(p, key)) for p in points]
            xs = [x for x, y in pairs if y is not None]
            ys = [y for _, y in pairs if y is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=scenario)
        rate = any(p.get("rate") for p in result["points"])
        ax.set_xlabel("request rate (req/s)" if rate else "concurrency")
        ax.set_ylabel(label)
        ax.set_title(f"{result['topology']['name']}: {label}")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written + draw_scenario_figures([(result["run_id"], result)], out_dir)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _stats_text(spread: dict[str, float] | None, digits: int = 0) -> str:
    if not spread:
        return "-"
    return "/".join(_num(spread[k], digits) for k in ("min", "mean", "max"))


def _point_row(p: dict[str, Any], sla: dict[str, Any]) -> str:
    c, roles = p["client"], p["roles"]
    prefill = roles.get("prefill") or roles.get("combined") or {}
    kv = sum((r.get("kv_transfers") or 0) for r in roles.values())
    kv_failed = sum((r.get("kv_transfer_failures") or 0) for r in roles.values())
    misses = [v["figure"] for v in p["verdicts"] if not v["ok"]]
    sla_text = "miss: " + ", ".join(misses) if misses else ("met" if p["verdicts"] else "-")
    ttft = c.get(_stat_key("ttft_ms", sla["ttft_statistic"]))
    tpot = c.get(_stat_key("tpot_ms", sla["tpot_statistic"]))
    spec = [r.get("spec_acceptance_rate") for r in roles.values()]
    spec_text = ", ".join(f"{v:.0%}" for v in spec if v is not None) or "-"
    return (
        f"| {p['scenario']} | {p['label']} | {_verdict(p)} "
        f"| {_num(p['per_gpu'].get('output_tok_s_per_gpu'))} "
        f"| {_num(p['per_gpu'].get('output_tok_s_per_user'))} "
        f"| {_num(ttft)} ({sla['ttft_statistic']}) | {_num(tpot)} ({sla['tpot_statistic']}) "
        f"| {_num(c.get('request_throughput'), 2)} "
        f"| {_num(prefill.get('prefill_tok_s_per_gpu'))} | {kv:g} ({kv_failed:g}) "
        f"| {spec_text} | {sla_text} |"
    )


def _telemetry_lines(result: dict[str, Any]) -> list[str]:
    rows = []
    for p in result["points"]:
        tele = p.get("telemetry") or {}
        for host, h in sorted((tele.get("hosts") or {}).items()):
            rows.append(
                f"| {p['scenario']} | {p['label']} | {host} | {h['gpus']} | {h['samples']} "
                f"| {_stats_text(h.get('memory_used_mib'))} | {_stats_text(h.get('power_w'), 1)} "
                f"| {_stats_text(h.get('util_pct'))} |"
            )
    if not rows:
        sources = {str((r.get("telemetry") or {}).get("why")) for r in result.get("rounds", [])}
        return ["", "## GPU telemetry", "", "not sampled: " + ", ".join(sorted(sources))]
    return [
        "",
        "## GPU telemetry (min/mean/max over the round's samples and GPUs)",
        "",
        "| scenario | load | host | GPUs | samples | memory used MiB | power W | util % |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def markdown(result: dict[str, Any], plots: list[Path]) -> str:
    topo = result["topology"]
    verdict = result.get("verdict") or ("PASS" if result["passed"] else "FAIL")
    lines = [
        f"# Bench {result['run_id']}",
        "",
        f"- topology: {topo['name']} ({topo['file']}), digest {topo['digest'][:16]}, "
        f"{topo['gpus']} GPUs ({', '.join(f'{k} {v}' for k, v in topo['gpus_by_role'].items())})",
        f"- release: {result['release_id']}",
        "- engines: " + ", ".join(f"{k} {v}" for k, v in result["engine_versions"].items()),
        f"- through: {result['proxy_url']}, generator {result['generator']['name']}",
        f"- result: {verdict}",
    ]
    if result.get("refused"):
        lines.append(f"- refused: {result['refused']}")
    slas = {s["name"]: _sla_of(s) for s in result["scenarios"]}
    lines += [
        "",
        "| scenario | load | verdict | out tok/s/GPU | out tok/s/user | TTFT ms | TPOT ms | req/s "
        "| prefill tok/s/GPU | KV transfers (failed) | spec accept | SLA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_point_row(p, slas[p["scenario"]]) for p in result["points"]]
    if result.get("invalid"):
        lines += ["", "## INVALID (the KV of a P/D round did not all move: not evidence)", ""]
        lines += [
            f"- {b['scenario']} {b['point']}: {'; '.join(b['why'])}" for b in result["invalid"]
        ]
    if result["verdicts"]:
        lines += ["", "## SLA misses", ""]
        lines += [f"- {miss_text(v)}" for v in result["verdicts"]]
    lines += _telemetry_lines(result)
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def miss_text(v: dict[str, Any]) -> str:
    value = "none" if v["value"] is None else f"{v['value']:.3g}"
    unit = f" {v['unit']}" if v["unit"] else ""
    want = ">=" if v["op"] == ">=" else "<="
    return (
        f"{v['scenario']} {v['point']}: {v['figure']} {value}{unit}, SLA {want} "
        f"{v['target']:g}{unit}"
    )


def write_report(run_dir: Path, result: dict[str, Any]) -> Path:
    plots = plot_run(result, run_dir) if result["points"] else []
    path = run_dir / "report.md"
    path.write_text(markdown(result, plots))
    return path


def regressions(runs: list[dict[str, Any]], margin_pct: float) -> list[str]:
    """Figures of the later runs that are worse than the first run's by more than margin_pct
    (lower throughput, higher latency), one line each."""
    base = {(p["scenario"], p["label"]): p for p in runs[0]["points"]}
    out = []
    for run in runs[1:]:
        for p in run["points"]:
            ref = base.get((p["scenario"], p["label"]))
            if ref is None:
                continue
            for key, label, higher_is_better in COMPARED:
                old, new = figure(ref, key), figure(p, key)
                if old is None or new is None or old == 0:
                    continue
                change = (new - old) / old * 100
                worse = -change if higher_is_better else change
                if worse > margin_pct:
                    out.append(
                        f"{run['run_id']} {p['scenario']} {p['label']}: {label} {new:.2f} vs "
                        f"{old:.2f} ({change:+.1f}%, margin {margin_pct:g}%)"
                    )
    return out


def compare(runs: list[dict[str, Any]]) -> str:
    """Runs side by side per scenario and load point; deltas against the first run."""
    base = runs[0]
    header = ["scenario", "load", "figure"] + [r["run_id"] for r in runs]
    rows: list[list[str]] = []
    keys: list[tuple[str, str]] = []
    for run in runs:
        for p in run["points"]:
            if (p["scenario"], p["label"]) not in keys:
                keys.append((p["scenario"], p["label"]))
    index = [{(p["scenario"], p["label"]): p for p in run["points"]} for run in runs]
    for key in keys:
        verdicts = [_verdict(index[i][key]) if key in index[i] else "-" for i in range(len(runs))]
        rows.append([key[0], key[1], "verdict", *verdicts])
        for fig_key, fig_label, _higher in COMPARED:
            base_p = index[0].get(key)
            base_v = figure(base_p, fig_key) if base_p else None
            cells = []
            for i, _run in enumerate(runs):
                p = index[i].get(key)
                v = figure(p, fig_key) if p else None
                cell = _num(v, 2)
                if i and v is not None and base_v:
                    cell += f" ({(v - base_v) / base_v * 100:+.1f}%)"
                cells.append(cell)
            rows.append([key[0], key[1], fig_label, *cells])
    info = [
        "runs: "
        + "; ".join(
            f"{r['run_id']} = {r['topology']['name']} {r['topology']['gpus']} GPUs "
            f"digest {r['topology']['digest'][:12]} release {r['release_id']}"
            for r in runs
        ),
        f"deltas against {base['run_id']}; figures per GPU use each run's own GPU count",
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    text = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    text.append("-+-".join("-" * w for w in widths))
    for row in rows:
        text.append(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(info + [""] + text) + "\n"
