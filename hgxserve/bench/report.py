"""A run's report (report.md + PNG plots) and `bench compare` (runs side by side, deltas).

Plots follow the seeds' figures 3.1-3.3: throughput, TTFT and TPOT against concurrency (or
request rate), one line per scenario.
"""

from __future__ import annotations

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


def figure(point: dict[str, Any], key: str) -> float | None:
    """A figure of a load point, from the client figures or the per-GPU ones."""
    for part in ("client", "per_gpu"):
        value = point.get(part, {}).get(key)
        if value is not None:
            return float(value)
    return None


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
        if scenarios:
            ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any], plots: list[Path]) -> str:
    topo = result["topology"]
    lines = [
        f"# Bench {result['run_id']}",
        "",
        f"- topology: {topo['name']} ({topo['file']}), digest {topo['digest'][:16]}, "
        f"{topo['gpus']} GPUs ({', '.join(f'{k} {v}' for k, v in topo['gpus_by_role'].items())})",
        f"- release: {result['release_id']}",
        "- engines: " + ", ".join(f"{k} {v}" for k, v in result["engine_versions"].items()),
        f"- through: {result['proxy_url']}, generator {result['generator']['name']}",
        f"- result: {'PASS' if result['passed'] else 'FAIL'}",
    ]
    if result.get("refused"):
        lines.append(f"- refused: {result['refused']}")
    lines += [
        "",
        "| scenario | load | req/s | out tok/s/GPU | TTFT p50/p90 ms | TPOT p50/p90 ms "
        "| prefill tok/s/GPU | KV transfers (failed) | SLA |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        c, roles = p["client"], p["roles"]
        prefill = roles.get("prefill") or roles.get("combined") or {}
        kv = sum((r.get("kv_transfers") or 0) for r in roles.values())
        kv_failed = sum((r.get("kv_transfer_failures") or 0) for r in roles.values())
        misses = [v["figure"] for v in p["verdicts"] if not v["ok"]]
        sla = "miss: " + ", ".join(misses) if misses else ("met" if p["verdicts"] else "-")
        lines.append(
            f"| {p['scenario']} | {p['label']} | {_num(c.get('request_throughput'), 2)} "
            f"| {_num(p['per_gpu'].get('output_tok_s_per_gpu'))} "
            f"| {_num(c.get('ttft_ms_p50'))} / {_num(c.get('ttft_ms_p90'))} "
            f"| {_num(c.get('tpot_ms_p50'))} / {_num(c.get('tpot_ms_p90'))} "
            f"| {_num(prefill.get('prefill_tok_s_per_gpu'))} | {kv:g} ({kv_failed:g}) | {sla} |"
        )
    if result["verdicts"]:
        lines += ["", "## SLA misses", ""]
        lines += [f"- {miss_text(v)}" for v in result["verdicts"]]
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
