"""The tune's loop: prune, estimate, then per survivor deploy -> bench -> record; then leave the
lab on the best candidate (or the baseline) and write the report.

A candidate is deployed the way an operator deploys it: the pyinfra CLI runs `deploys/site.py`
with `--data topology=<candidate>` and the SPEC's stages and data, so its release stages, switches,
gates and confirms or rolls back exactly as `pyinfra inventory/lab.py deploys/site.py` does; a
release that fails is rolled back by that machinery and recorded here as failed with its reason.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hgxserve.base.defaults import TUNE_DEPLOY_TIMEOUT_S
from hgxserve.tune import choose, prune, state
from hgxserve.tune.estimate import estimate
from hgxserve.tune.spec import TuneSpec

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "deploys" / "site.py"
# lines of a failed deploy's output that say why (the release's diagnosed cause, the revert)
_WHY = ("error", "failed", "revert", "rolled back", "refused")
_PID_POLL_S = 2.0


@dataclass
class TuneOptions:
    run_dir: Path
    inventory: Path
    progress: Callable[[str], None]
    tokenizer: str | None = None
    api_key: str | None = None
    metrics_key: str | None = None  # the proxy's /metrics key (proxy.auth.metrics_key)
    from_host: str | None = None
    round_timeout_s: float = 3600.0
    deploy_timeout_s: float = TUNE_DEPLOY_TIMEOUT_S
    # the base's bench spec and the scenarios each candidate runs (scenarios_of)
    scenarios: tuple[Any, list[Any]] | None = None


def pyinfra_command() -> str:
    """The pyinfra beside this Python (the same venv), else on PATH."""
    beside = Path(sys.executable).with_name("pyinfra")
    return str(beside) if beside.exists() else "pyinfra"


def deploy_argv(spec: TuneSpec, topology: Path, inventory: Path) -> list[str]:
    """The pyinfra command of one candidate's release: each `key=value` one argv word, only the
    keys the deploy table marks tunable (load_spec refused the others; checked again here for a
    TuneSpec built another way)."""
    from hgxserve.base.errors import UsageError
    from hgxserve.deploy.data import untunable

    refused = [why for key, value in spec.data.items() if (why := untunable(key, value))]
    if refused:
        raise UsageError("; ".join(refused))
    argv = [pyinfra_command(), "-y", str(inventory), str(SITE)]
    argv += [
        "--data",
        f"topology={topology.resolve()}",
        "--data",
        "stages=" + ",".join(spec.stages),
    ]
    for key, value in spec.data.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        argv += ["--data", f"{key}={text}"]
    return argv


def _why(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    said = [line for line in lines if any(w in line.lower() for w in _WHY)]
    return " | ".join((said or lines)[-6:])[-2000:] or "pyinfra failed without output"


def _wait_gone(pid: int | None, timeout_s: float, progress: Callable[[str], None]) -> None:
    """A deploy a killed tune left running must end before another starts (bounded)."""
    if not pid:
        return
    deadline = time.monotonic() + timeout_s
    announced = False
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        if not announced:
            progress(f"waiting for the deploy the stopped tune left running (pid {pid})")
            announced = True
        time.sleep(_PID_POLL_S)


def deploy(
    spec: TuneSpec, topology: Path, opts: TuneOptions, tune: dict[str, Any], tag: str
) -> tuple[bool, str]:
    """Run one release of `topology`; (ok, reason)."""
    _wait_gone(tune.get("deploy_pid"), opts.deploy_timeout_s, opts.progress)
    log = opts.run_dir / "deploys" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = deploy_argv(spec, topology, opts.inventory)
    opts.progress(f"deploy {topology.name}: {' '.join(argv[2:])} (log {log})")
    with (
        open(log, "w") as out,
        subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        ) as proc,
    ):
        tune["deploy_pid"] = proc.pid
        tune["deployed"] = None  # until it ends, the lab runs this, the previous one or neither
        state.save(opts.run_dir, tune)
        try:
            code = proc.wait(opts.deploy_timeout_s)
        except BaseException:  # a timeout, Ctrl-C or SIGTERM: no deploy outlives the tune
            proc.kill()
            proc.wait()
            raise
    tune["deploy_pid"] = None
    if code != 0:
        return False, f"release failed (pyinfra exit {code}): {_why(log)}"
    tune["deployed"] = str(topology)
    return True, ""


def read_releases(topo: Any, inventory: Path) -> tuple[str, dict[str, Any]]:
    """`host=release` of each host the topology uses (`hgxserve release status` over SSH), and
    host -> what each engine of that release recorded (start time, KV capacity)."""
    import json

    from hgxserve.base.paths import AGENT
    from hgxserve.remote.inventory import load_inventory
    from hgxserve.remote.ssh import Sessions

    names = topo.hosts_in_use()
    hosts = load_inventory(str(inventory)).select(names)
    with Sessions(hosts) as sessions:
        results = sessions.run_all(f"{AGENT} release status", 30)
    parts, observed = [], {}
    for name in names:
        result = results.get(name)
        running = "unknown"
        if result is not None and result.ok and result.exit_status == 0:
            with contextlib.suppress(ValueError, AttributeError):
                doc = json.loads(result.stdout)
                running = (doc.get("pending") or {}).get("id") or doc.get("current") or "none"
                if doc.get("observed"):
                    observed[name] = doc["observed"]
        parts.append(f"{name}={running}")
    return " ".join(parts), observed


def scenarios_of(spec: TuneSpec) -> tuple[Any, list[Any]]:
    """The base's bench spec and the scenarios every candidate runs (the SPEC's SLA over each)."""
    from hgxserve.bench.scenario import _sla, load_bench

    base = load_bench(spec.base)
    picked = base.pick(list(spec.scenarios))
    if spec.sla is not None:
        picked = [replace(s, sla=_sla(spec.sla)) for s in picked]
    return base, picked


def bench(
    topology: Path, scenarios: tuple[Any, list[Any]], opts: TuneOptions, release: str
) -> tuple[Path | None, dict[str, Any]]:
    """Bench the deployed candidate through its proxy; (bench run dir or None, result)."""
    from hgxserve.bench import generator, metrics, report
    from hgxserve.bench.reach import open_reach
    from hgxserve.bench.run import RoundRefused, options_through, run_bench
    from hgxserve.bench.scenario import BenchSpec
    from hgxserve.topology import load_topology

    base, picked = scenarios
    topo = load_topology(topology)
    spec = BenchSpec(topo, tuple(picked), base.drain_timeout_s, base.source)
    reach = open_reach(
        topo,
        inventory=str(opts.inventory),
        from_host=opts.from_host,
        proxy_url=None,
        engine_urls={},
    )
    run_opts = options_through(reach, opts, opts.run_dir / "bench", release)
    try:
        run_dir, result = run_bench(spec, picked, run_opts, opts.progress)
    except (RoundRefused, generator.GeneratorError, metrics.MetricsError) as exc:
        return None, {"refused": str(exc), "passed": False, "points": []}
    finally:
        reach.close()
    report.write_report(run_dir, result)
    return run_dir, result


def run_candidate(spec: TuneSpec, record: dict[str, Any], opts: TuneOptions, tune: dict) -> None:
    """Deploy and bench one candidate, recording each step in the state file."""
    record["attempts"] += 1
    record.update(status="deploying", started=state.now(), reasons=[])
    state.save(opts.run_dir, tune)
    ok, why = deploy(
        spec, Path(record["file"]), opts, tune, f"{record['name']}-{record['attempts']}"
    )
    if not ok:
        record.update(status="failed", reasons=[why], verdict="FAILED", finished=state.now())
        state.save(opts.run_dir, tune)
        opts.progress(f"{record['name']}: {why}")
        return
    from hgxserve.topology import load_topology

    record["release"], _ = read_releases(load_topology(record["file"]), opts.inventory)
    record["status"] = "benching"
    state.save(opts.run_dir, tune)
    assert opts.scenarios is not None
    run_dir, result = bench(Path(record["file"]), opts.scenarios, opts, record["release"])
    figures = choose.point_figures(result)
    record.update(
        status="done",
        bench_run=str(run_dir) if run_dir else None,
        verdict=choose.verdict(result),
        figures=figures,
        score=choose.score(figures),
        finished=state.now(),
    )
    if result.get("refused"):
        record["reasons"] = [f"bench refused: {result['refused']}"]
    state.save(opts.run_dir, tune)
    opts.progress(f"{record['name']}: {record['verdict']}, score {record['score']}")


def add_candidates(spec: TuneSpec, tune: dict[str, Any], opts: TuneOptions) -> list[prune.Checked]:
    """Every candidate (expanding a matrix into the run directory), pruned or not."""
    from hgxserve.tune import matrix

    if spec.matrix:
        files = [p for p, _ in matrix.expand(spec.base, spec.matrix, opts.run_dir / "candidates")]
    else:
        files = list(spec.candidates)
    checked = [prune.check(f) for f in files]
    for c in checked:
        topo = c.topology
        name = topo.name if topo is not None else c.file.stem
        record = state.add_candidate(
            tune,
            name,
            str(c.file.resolve()),
            gpus=sum(e.gpu_count for e in topo.engines.values()) if topo else None,
            digest=topo.digest if topo else None,
            notes=c.notes,
        )
        if c.pruned and record["status"] == "pending":
            record.update(status="pruned", reasons=c.reasons)
    state.save(opts.run_dir, tune)
    return checked


def final_target(spec: TuneSpec, tune: dict[str, Any]) -> dict[str, Any]:
    """Where the lab is to be left: the winner, the baseline, or (nothing was deployed: every
    candidate pruned) where it is; `deploy` says whether a release is needed for it."""
    records = list(tune["candidates"].values())
    winner = choose.best(records)
    final: dict[str, Any] = {"winner": winner["name"] if winner else None}
    if spec.leave == "best" and winner is not None:
        target, why = str(Path(winner["file"])), f"best candidate {winner['name']}"
    elif not any(r["attempts"] for r in records):
        return {**final, "left_on": None, "why": "nothing was deployed", "deploy": False}
    else:
        target = str(spec.baseline_file.resolve())
        why = "leave: baseline" if spec.leave == "baseline" else "no candidate met the SLA"
        why = f"baseline ({why})"
    return {**final, "left_on": target, "why": why, "deploy": tune.get("deployed") != target}


def leave(spec: TuneSpec, tune: dict[str, Any], opts: TuneOptions) -> bool:
    """Deploy the winner (or the baseline); record it in `final`; True when the lab is on it."""
    final = final_target(spec, tune)
    if final.pop("deploy"):
        ok, reason = deploy(spec, Path(final["left_on"]), opts, tune, "final")
        final.update(deployed=ok, redeployed=True, reason=reason or None)
    else:
        final.update(deployed=True, redeployed=False)
    if final["deployed"] and final["left_on"]:
        from hgxserve.topology import load_topology

        final["release"], _ = read_releases(load_topology(final["left_on"]), opts.inventory)
    final["finished"] = state.now()
    tune["final"] = final
    state.save(opts.run_dir, tune)
    return bool(final["deployed"])


def run_tune(spec: TuneSpec, opts: TuneOptions, tune: dict[str, Any]) -> dict[str, Any]:
    """The whole tune (or the rest of a resumed one); the final state."""
    checked = add_candidates(spec, tune, opts)
    for c in checked:
        if c.pruned:
            opts.progress(f"pruned {c.file}: " + "; ".join(c.reasons))
    if opts.scenarios is None:
        opts.scenarios = scenarios_of(spec)
    tune["scenarios"] = [s.to_dict() for s in opts.scenarios[1]]
    survivors = [c for c in checked if not c.pruned]
    _, observed = _observed(survivors, opts)
    total, lines = estimate([c.topology for c in survivors], opts.scenarios[1], observed)
    for line in lines:
        opts.progress(line)
    tune["estimate_s"] = round(total)
    state.save(opts.run_dir, tune)
    for record in state.to_run(tune):
        run_candidate(spec, record, opts, tune)
    leave(spec, tune, opts)
    return tune


def _observed(survivors: list[prune.Checked], opts: TuneOptions) -> tuple[str, dict[str, Any]]:
    """What the lab's running release measured (engine start times), for the estimate."""
    from hgxserve.base.errors import HgxserveError

    for c in survivors:
        if c.topology is not None:
            with contextlib.suppress(HgxserveError, OSError):
                return read_releases(c.topology, opts.inventory)
    return "", {}
