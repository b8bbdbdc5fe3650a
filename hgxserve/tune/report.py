"""The tune's report in its run directory: report.json (every candidate's record), report.md (per
candidate per scenario: tok/s/GPU, tok/s/user, TTFT / TPOT at the SLA statistic, verdict; the
pruned ones with every reason; where the lab was left) and, with matplotlib, tune.png (output
tok/s per GPU against tok/s per user, one line per candidate, SLA-met points filled)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ran(candidates: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| candidate | GPUs | scenario | load | tok/s/GPU | tok/s/user | TTFT ms | TPOT ms "
        "| statistic | SLA | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in candidates:
        figures = c.get("figures") or [{}]
        for f in figures:
            cells = (
                c["name"],
                str(c.get("gpus")),
                f.get("scenario", "-"),
                f.get("point", "-"),
                _num(f.get("tok_s_per_gpu")),
                _num(f.get("tok_s_per_user")),
                _num(f.get("ttft_ms")),
                _num(f.get("tpot_ms")),
                f.get("statistic", "-"),
                f.get("sla", "-"),
                c.get("verdict") or c["status"],
            )
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(tune: dict[str, Any], plots: list[Path]) -> str:
    records = list(tune["candidates"].values())
    ran = [r for r in records if r["status"] != "pruned"]
    pruned = [r for r in records if r["status"] == "pruned"]
    final = tune.get("final") or {}
    lines = [
        f"# Tune {Path(tune.get('run_dir', '.')).name}",
        "",
        f"- SPEC: {tune['spec']} (sha256 {tune['spec_digest'][:16]})",
        f"- started {tune['started']}, finished {final.get('finished', '-')}",
        f"- winner: {final.get('winner') or 'none met the SLA'}",
        f"- lab left on: {final.get('left_on', '-')} ({final.get('why', '-')}), "
        f"deployed: {final.get('deployed')}, release {final.get('release', '-')}",
        "- score: output tok/s per GPU, per scenario its best load point, averaged over scenarios",
        "- scenarios: "
        + "; ".join(
            f"{s['name']} {s['input']}/{s['output']} SLA {sla_text(s.get('sla') or {})}"
            for s in tune.get("scenarios") or []
        ),
        "",
        "## Candidates",
        "",
        *_ran(ran),
        "",
        "| candidate | score | attempts | release | bench run |",
        "|---|---|---|---|---|",
    ]
    for r in ran:
        lines.append(
            f"| {r['name']} | {_num(r.get('score'))} | {r['attempts']} | {r.get('release') or '-'} "
            f"| {r.get('bench_run') or '-'} |"
        )
    failed = [r for r in ran if r.get("reasons")]
    if failed:
        lines += ["", "## Failed", ""] + [
            f"- {r['name']}: {'; '.join(r['reasons'])}" for r in failed
        ]
    if pruned:
        lines += ["", "## Pruned before any deploy", ""]
        for r in pruned:
            lines.append(f"- {r['name']} ({r['file']}):")
            lines += [f"  - {why}" for why in r["reasons"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _shade_sla(ax: Any, tune: dict[str, Any]) -> None:
    """Shade where tok/s/user meets the TPOT target, when every scenario has the same one."""
    targets = {(s.get("sla") or {}).get("tpot_ms") for s in tune.get("scenarios") or []}
    tpot = targets.pop() if len(targets) == 1 else None
    if tpot is None:
        return
    left, right = ax.get_xlim()
    edge = 1000.0 / float(tpot)
    ax.axvspan(
        edge, max(right, edge * 1.1), color="tab:green", alpha=0.08, label=f"TPOT <= {tpot:g} ms"
    )
    ax.set_xlim(min(left, edge * 0.9), max(right, edge * 1.1))


def plot(tune: dict[str, Any], out_dir: Path) -> list[Path]:
    """tune.png, when matplotlib is installed; none otherwise."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    for c in tune["candidates"].values():
        pts = [
            f
            for f in c.get("figures") or []
            if f.get("tok_s_per_user") is not None and f.get("tok_s_per_gpu") is not None
        ]
        if not pts:
            continue
        pts.sort(key=lambda f: f["tok_s_per_user"])
        xs, ys = [f["tok_s_per_user"] for f in pts], [f["tok_s_per_gpu"] for f in pts]
        (line,) = ax.plot(xs, ys, label=f"{c['name']} ({c.get('verdict')})")
        met = [(f["tok_s_per_user"], f["tok_s_per_gpu"]) for f in pts if f["sla"] == "met"]
        missed = [(f["tok_s_per_user"], f["tok_s_per_gpu"]) for f in pts if f["sla"] != "met"]
        for group, face in ((met, line.get_color()), (missed, "none")):
            if group:
                ax.scatter(*zip(*group, strict=True), facecolors=face, edgecolors=line.get_color())
    _shade_sla(ax, tune)
    ax.set_xlabel("output tokens/s per user (1000 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("tune: candidates (filled: SLA met)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / "tune.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def write(run_dir: Path, tune: dict[str, Any]) -> Path:
    """report.json, report.md and the plot; the markdown's path."""
    doc = {**tune, "run_dir": str(run_dir)}
    tmp = run_dir / "report.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(run_dir / "report.json")
    path = run_dir / "report.md"
    path.write_text(markdown(doc, plot(tune, run_dir)))
    return path


def sla_text(sla: dict[str, Any]) -> str:
    """A scenario's SLA as its targets read, each latency at its statistic.

    >>> sla_text({"percentile": 90, "ttft_statistic": "mean", "ttft_s": 3, "tpot_ms": 40})
    'TTFT mean <= 3 s, TPOT p90 <= 40 ms'
    """
    default = sla.get("statistic") or f"p{sla.get('percentile', 90)}"
    parts = []
    if sla.get("ttft_s") is not None:
        parts.append(f"TTFT {sla.get('ttft_statistic') or default} <= {sla['ttft_s']:g} s")
    if sla.get("tpot_ms") is not None:
        parts.append(f"TPOT {sla.get('tpot_statistic') or default} <= {sla['tpot_ms']:g} ms")
    for key, op in (
        ("prefill_tok_s_per_gpu", ">="),
        ("output_tok_s_per_gpu", ">="),
        ("error_rate", "<="),
    ):
        if sla.get(key) is not None:
            parts.append(f"{key} {op} {sla[key]:g}")
    return ", ".join(parts) or "none"
