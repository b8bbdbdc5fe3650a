"""One bench run: every round of the chosen scenarios, clean, measured, judged and kept.

A round is refused unless the proxy has no outstanding request and every engine reads zero
running and zero waiting (waiting up to `drain_timeout_s` first); its requests carry the id
prefix `<run id>-<round>`; afterwards the engines that answer clients (decode, combined) must
have finished exactly as many requests as the round sent - more means another client was
sending, fewer means requests were lost (seed 003 §11.4).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hgxserve.base.errors import ExitCode, HgxserveError
from hgxserve.base.versioned import read_versioned
from hgxserve.bench import generator, metrics
from hgxserve.bench.relay import RoundRelay
from hgxserve.bench.scenario import BenchSpec, LoadPoint, Scenario, stat_key

if TYPE_CHECKING:
    from hgxserve.bench.reach import Reach

SCHEMA_VERSION = 1
POLL_S = 1.0
# After AIPerf returns, the engines' counters settle within their metrics interval.
SETTLE_TIMEOUT_S = 30.0


class RoundRefused(HgxserveError):
    """A round could not start clean, or ended unclean; the message has the numbers."""

    exit_code = ExitCode.FAILED


@dataclass
class RunOptions:
    out_root: Path
    proxy_url: str | None = None
    engine_urls: dict[str, str] = field(default_factory=dict)
    tokenizer: str | None = None
    api_key: str | None = None
    metrics_key: str | None = None  # the proxy's /metrics key (proxy.auth.metrics_key)
    release_id: str | None = None
    round_timeout_s: float = 3600.0
    drain_timeout_s: float | None = None
    origin: str = "controller"  # where the connections to the proxy start
    # host -> engine unit -> start time and KV capacity its release recorded (kvcap), when read
    engines_observed: dict[str, Any] = field(default_factory=dict)
    # GPU telemetry during each round (hgxserve.bench.telemetry.Sampler); None: not sampled
    telemetry: Any = None
    telemetry_why_none: str = "not sampled"


class RoundKnobs(Protocol):
    """What a bench request and a tune give every round alike."""

    @property
    def tokenizer(self) -> str | None: ...

    @property
    def api_key(self) -> str | None: ...

    @property
    def metrics_key(self) -> str | None: ...

    @property
    def round_timeout_s(self) -> float: ...


def options_through(
    reach: Reach, knobs: RoundKnobs, out_root: Path, release_id: str | None, **more: Any
) -> RunOptions:
    """The options of a run into `out_root` through `reach` (its proxy, engines and origin),
    with `knobs` and `more` (the other RunOptions fields)."""
    return RunOptions(
        out_root=out_root,
        proxy_url=reach.proxy_url,
        engine_urls=reach.engine_urls,
        tokenizer=knobs.tokenizer,
        api_key=knobs.api_key,
        metrics_key=knobs.metrics_key,
        release_id=release_id,
        round_timeout_s=knobs.round_timeout_s,
        origin=reach.origin,
        **more,
    )


def _busy_text(busy: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in busy.items())


def wait_idle(
    t: metrics.Targets, timeout_s: float, progress: Callable[[str], None], label: str
) -> metrics.Snapshot:
    """A snapshot taken when nothing is in flight; RoundRefused after timeout_s."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        snap = metrics.snapshot(t)
        busy = metrics.busy(t, snap)
        if not busy:
            return snap
        if time.monotonic() >= deadline:
            raise RoundRefused(
                f"round {label} refused: still busy after {timeout_s:g} s: {_busy_text(busy)} "
                "(another client is sending, or requests are stuck; stop it and run again)"
            )
        if not announced:
            progress(f"  {label}: waiting up to {timeout_s:g} s for {_busy_text(busy)}")
            announced = True
        time.sleep(POLL_S)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def per_gpu(client: dict[str, float | None], gpus: int) -> dict[str, float | None]:
    """Client throughput divided by the topology's GPUs (seed 003 §7: total / GPUs)."""

    def div(v: float | None) -> float | None:
        return v / gpus if v is not None and gpus else None

    per_user = client.get("output_tok_s_per_user")
    tpot = client.get("tpot_ms_avg")
    if per_user is None and tpot:
        per_user = 1000 / tpot  # one user's streamed tokens/s at the mean TPOT
    return {
        "output_tok_s_per_gpu": div(client.get("output_token_throughput")),
        "total_tok_s_per_gpu": div(client.get("total_token_throughput")),
        "output_tok_s_per_user": per_user,
        "gpus": float(gpus),
    }


def verdicts(scenario: Scenario, point: dict[str, Any]) -> list[dict[str, Any]]:
    """Each SLA target of the scenario against a load point's median figures, the latencies at
    the SLA's statistic (mean or a percentile, per figure)."""
    sla = scenario.sla
    ttft_stat, tpot_stat = sla.statistic_for("ttft"), sla.statistic_for("tpot")
    client, gpu, roles = point["client"], point["per_gpu"], point["roles"]
    prefill_role = "prefill" if "prefill" in roles else "combined"
    checks: list[tuple[str, float | None, float | None, str, str]] = []

    def ms_to_s(v: float | None) -> float | None:
        return v / 1000 if v is not None else None

    ttft = ms_to_s(client.get(stat_key("ttft_ms", ttft_stat)))
    checks.append((f"TTFT {ttft_stat}", ttft, sla.ttft_s, "<=", "s"))
    tpot = client.get(stat_key("tpot_ms", tpot_stat))
    checks.append((f"TPOT {tpot_stat}", tpot, sla.tpot_ms, "<=", "ms"))
    checks.append(
        (
            f"{prefill_role} tok/s/GPU",
            (roles.get(prefill_role) or {}).get("prefill_tok_s_per_gpu"),
            sla.prefill_tok_s_per_gpu,
            ">=",
            "tok/s",
        )
    )
    checks.append(
        ("output tok/s/GPU", gpu.get("output_tok_s_per_gpu"), sla.output_tok_s_per_gpu, ">=", "")
    )
    requests = (client.get("requests") or 0) + (client.get("errors") or 0)
    rate = (client.get("errors") or 0) / requests if requests else None
    checks.append(("error rate", rate, sla.error_rate, "<=", ""))
    out = []
    for figure, value, target, op, unit in checks:
        if target is None:
            continue
        ok = value is not None and (value <= target if op == "<=" else value >= target)
        out.append(
            {"figure": figure, "value": value, "target": target, "op": op, "unit": unit, "ok": ok}
        )
    return out


def _release_text(value: str | None) -> str:
    return value or "unknown"


def run_bench(
    spec: BenchSpec,
    scenarios: list[Scenario],
    opts: RunOptions,
    progress: Callable[[str], None],
) -> tuple[Path, dict[str, Any]]:
    """Run every round; write run.json into a new run directory; return (dir, result)."""
    topo = spec.topology
    t = metrics.targets(topo, proxy_url=opts.proxy_url, engine_urls=opts.engine_urls)
    t = replace(t, metrics_key=opts.metrics_key)
    gpus = t.gpus()
    started = datetime.now(timezone.utc)
    run_id = f"{started:%Y%m%dT%H%M%SZ}-{topo.name}"
    run_dir = opts.out_root / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    drain = spec.drain_timeout_s if opts.drain_timeout_s is None else opts.drain_timeout_s
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "started": started.isoformat(),
        "topology": {
            "name": topo.name,
            "file": topo.source_file,
            "digest": topo.digest,
            "gpus": gpus,
            "gpus_by_role": {r: t.gpus(r) for r in sorted({e.role for e in t.engines})},
        },
        "scenario_source": spec.source,
        "release_id": _release_text(opts.release_id),
        "proxy_url": t.proxy_url,
        "load_from": opts.origin,
        "engine_versions": metrics.engine_versions(t),
        "engines_observed": opts.engines_observed,
        "generator": {"name": "aiperf", "command": generator.aiperf_command()[0]},
        "scenarios": [s.to_dict() for s in scenarios],
        "rounds": [],
        "points": [],
        "verdicts": [],
        "passed": None,
        "refused": None,
    }
    _check_datasets(scenarios, progress)
    progress(
        f"bench {run_id}: {len(scenarios)} scenario(s) through {t.proxy_url} from "
        f"{opts.origin}, {gpus} GPUs, "
        f"results in {run_dir}"
    )
    try:
        with RoundRelay(t.proxy_url, run_id, opts.api_key) as relay:
            bench = _Bench(t, relay, run_dir, opts, drain, progress, result)
            for scenario in scenarios:
                for point in scenario.load_points():
                    rounds = [_round(bench, scenario, point, seed) for seed in scenario.seeds]
                    result["points"].append(_point(scenario, point, rounds, gpus))
                    _write(run_dir, result)
    except (RoundRefused, generator.GeneratorError, metrics.MetricsError) as exc:
        result["refused"] = str(exc)
        result["passed"] = False
        result["verdict"] = INVALID
        result["scenario_verdicts"] = scenario_verdicts(result)
        _write(run_dir, result)
        raise
    _finish(result)
    _write(run_dir, result)
    return run_dir, result


PASS, FAIL, INVALID = "PASS", "FAIL", "INVALID"


def _finish(result: dict[str, Any]) -> None:
    """The run's SLA misses, its invalid load points, `passed` and its verdict: INVALID when a
    load point is no valid evidence (whatever its SLA says), else FAIL on a miss, else PASS."""
    misses = []
    for point in result["points"]:
        for v in point["verdicts"]:
            if not v["ok"]:
                misses.append({"scenario": point["scenario"], "point": point["label"], **v})
    result["verdicts"] = misses
    result["invalid"] = [
        {"scenario": p["scenario"], "point": p["label"], "why": p["invalid_why"]}
        for p in result["points"]
        if not p["valid"]
    ]
    result["passed"] = not misses and not result["invalid"]
    result["verdict"] = INVALID if result["invalid"] else (FAIL if misses else PASS)
    result["scenario_verdicts"] = scenario_verdicts(result)
    result["finished"] = datetime.now(timezone.utc).isoformat()


def point_verdict(point: dict[str, Any]) -> str:
    """INVALID (a round's KV did not move), FAIL (an SLA target missed) or PASS."""
    if not point.get("valid", True):
        return INVALID
    return FAIL if any(not v["ok"] for v in point["verdicts"]) else PASS


def scenario_verdicts(result: dict[str, Any]) -> dict[str, str]:
    """Scenario -> INVALID if any of its load points is, else FAIL if any missed its SLA,
    else PASS; a scenario whose rounds did not all run (a refused run) is INVALID."""
    out: dict[str, str] = {}
    for scenario in result["scenarios"]:
        name = scenario["name"]
        points = [p for p in result["points"] if p["scenario"] == name]
        verdicts_ = {point_verdict(p) for p in points}
        if INVALID in verdicts_ or not points or (result.get("refused") and name == _last(result)):
            out[name] = INVALID
        else:
            out[name] = FAIL if FAIL in verdicts_ else PASS
    return out


def _last(result: dict[str, Any]) -> str | None:
    """The scenario a refused run stopped in."""
    rounds = result.get("rounds") or []
    return str(rounds[-1]["scenario"]) if rounds else None


def _check_datasets(scenarios: list[Scenario], progress: Callable[[str], None]) -> None:
    """Read every scenario's dataset before the first round: a bad file stops the run (exit 2)
    before any load is sent."""
    from hgxserve.bench.dataset import load_dataset

    for s in scenarios:
        if s.dataset is not None:
            entries, skipped = load_dataset(s.dataset, s.output)
            progress(
                f"  {s.name}: {len(entries)} prompts from {s.dataset.path} ({s.dataset.format}"
                + (f", {skipped} conversations skipped)" if skipped else ")")
            )


@dataclass
class _Bench:
    """What every round of one bench run works with: the targets, the relay, the run directory,
    the options, the drain timeout, the progress sink and the result so far."""

    t: metrics.Targets
    relay: RoundRelay
    run_dir: Path
    opts: RunOptions
    drain: float
    progress: Callable[[str], None]
    result: dict[str, Any]


def _round(bench: _Bench, scenario: Scenario, point: LoadPoint, seed: int) -> dict[str, Any]:
    t, relay, progress, result = bench.t, bench.relay, bench.progress, bench.result
    label = f"{scenario.name}-{point.label}-s{seed}"
    prefix = f"{result['run_id']}-{label}"
    progress(f"  round {label}: checking the proxy and engines are idle")
    before = wait_idle(t, bench.drain, progress, label)
    relay.new_round(prefix)
    shape = (
        f"dataset {scenario.dataset.path.name}"
        if scenario.dataset is not None
        else f"ISL {scenario.input} / OSL {scenario.output}"
    )
    progress(f"  round {label}: {point.label}, {shape}")
    t0 = time.monotonic()
    sampler = bench.opts.telemetry
    if sampler is not None:
        sampler.start()
    try:
        client = generator.run_round(
            generator.RoundArgs(
                url=relay.url,
                model=t.served_name,
                scenario=scenario,
                point=point,
                seed=seed,
                out_dir=bench.run_dir / "rounds" / label,
                tokenizer=bench.opts.tokenizer,
            ),
            progress=progress,
            timeout_s=bench.opts.round_timeout_s,
        )
    finally:
        telemetry = (
            sampler.stop()
            if sampler is not None
            else {"source": None, "why": bench.opts.telemetry_why_none, "hosts": {}}
        )
    elapsed = time.monotonic() - t0
    after = wait_idle(t, SETTLE_TIMEOUT_S, progress, label + " (after)")
    # AIPerf's wall time includes its start-up; the engines worked during the measured part
    window = client.get("duration_s") or elapsed
    engines = metrics.engine_figures(t, before, after, window)
    sent = relay.counts.sent
    finished = engines["requests_finished"]
    entry = {
        "label": label,
        "scenario": scenario.name,
        "point": point.label,
        "seed": seed,
        "request_id_prefix": prefix,
        "sent": sent,
        "engines_finished": finished,
        "client": client,
        "engines": engines,
        "kv": metrics.kv_validity(t, before, after),
        "telemetry": telemetry,
    }
    entry["valid"] = entry["kv"]["valid"]
    result["rounds"].append(entry)
    if finished != sent:
        why = "another client sent requests" if finished > sent else "requests were lost"
        raise RoundRefused(
            f"round {label} unclean: the round sent {sent} requests (id prefix {prefix}) but "
            f"the decode/combined engines finished {finished:g}: {why}"
        )
    if not entry["valid"]:
        progress(f"  round {label}: INVALID P/D evidence: {'; '.join(entry['kv']['why'])}")
    progress(
        f"  round {label}: {sent} requests, TTFT p50 {_fmt(client.get('ttft_ms_p50'))} ms, "
        f"TPOT p50 {_fmt(client.get('tpot_ms_p50'))} ms, "
        f"{_fmt(client.get('output_token_throughput'))} output tok/s"
    )
    return entry


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _point(
    scenario: Scenario, point: LoadPoint, rounds: list[dict[str, Any]], gpus: int
) -> dict[str, Any]:
    """The median over seeds of every figure of one load point, and its verdicts."""
    keys = sorted({k for r in rounds for k in r["client"]})
    client = {k: _median([r["client"].get(k) for r in rounds]) for k in keys}
    roles: dict[str, dict[str, float | None]] = {}
    for role in rounds[0]["engines"]["roles"]:
        fields = rounds[0]["engines"]["roles"][role].keys()
        roles[role] = {
            f: _median([r["engines"]["roles"][role].get(f) for r in rounds]) for f in fields
        }
    out = {
        "scenario": scenario.name,
        "label": point.label,
        "concurrency": point.concurrency,
        "rate": point.rate,
        "x": point.x,
        "seeds": [r["seed"] for r in rounds],
        "client": client,
        "per_gpu": per_gpu(client, gpus),
        "roles": roles,
        "valid": all(r.get("valid", True) for r in rounds),
        "invalid_why": [f"{r['label']}: {'; '.join(r['kv']['why'])}" for r in rounds
                        if not r.get("valid", True)],
        "kv": _kv_sum([r.get("kv") or {} for r in rounds]),
        "telemetry": merge_telemetry([r.get("telemetry") or {} for r in rounds]),
    }  # fmt: skip
    out["verdicts"] = verdicts(scenario, out)
    out["verdict"] = point_verdict(out)
    return out


def _kv_sum(kvs: list[dict[str, Any]]) -> dict[str, float]:
    """KV-transfer failures, decode-recomputed tokens and proxy handoffs over a point's rounds."""
    out = {"failed_transfers": 0.0, "decode_recomputed_tokens": 0.0, "pd_local_requests": 0.0}
    for kv in kvs:
        for key in out:
            out[key] += float(kv.get(key) or 0)
        for result, n in (kv.get("handoffs") or {}).items():
            out[f"handoffs_{result}"] = out.get(f"handoffs_{result}", 0.0) + float(n)
    return out


def merge_telemetry(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One load point's GPU telemetry over its rounds: per host, the lowest min, the mean of
    the means weighted by samples, the highest max."""
    hosts: dict[str, list[dict[str, Any]]] = {}
    for tele in rounds:
        for host, entry in (tele.get("hosts") or {}).items():
            hosts.setdefault(host, []).append(entry)
    merged: dict[str, Any] = {}
    for host, entries in hosts.items():
        samples = sum(e["samples"] for e in entries)
        row: dict[str, Any] = {"gpus": max(e["gpus"] for e in entries), "samples": samples}
        for figure in ("memory_used_mib", "power_w", "util_pct"):
            parts = [(e[figure], e["samples"]) for e in entries if e.get(figure)]
            row[figure] = (
                {
                    "min": min(p["min"] for p, _ in parts),
                    "mean": sum(p["mean"] * n for p, n in parts) / max(1, sum(n for _, n in parts)),
                    "max": max(p["max"] for p, _ in parts),
                }
                if parts
                else None
            )
        merged[host] = row
    sources = sorted({str(t.get("source")) for t in rounds if t.get("source")})
    return {"source": ", ".join(sources) or None, "hosts": merged}


def _write(run_dir: Path, result: dict[str, Any]) -> None:
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    tmp.replace(run_dir / "run.json")


def load_run(path: str | Path) -> dict[str, Any]:
    """A kept run: its directory or its run.json."""
    p = Path(path)
    if p.is_dir():
        p = p / "run.json"
    return read_versioned(p, SCHEMA_VERSION, "bench run", "bench run")
