"""The release's SLA gate (`gate.bench:`): after the probes pass, one bench scenario runs
through the proxy of the new release, from the gate's host; a missed SLA, a regression past
`max_regression_pct` against the last confirmed release's kept result, or a bench that cannot
run, fails the gate, and every switched host goes back like after any failed gate.

The bench runs on the controller (`hgxserve bench`, AIPerf) in a child process, with its
connections to the proxy starting on the gate's host (`--from`, an SSH tunnel) and each
engine's /metrics read through its own host. Its result is kept on the gate's host beside the
release it measured, `releases/<id>/bench/run.json` (+ report.md), which is where the next
release's regression check reads "the last confirmed release's kept result".
"""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.base.defaults import BENCH_RUNS_DIR
from hgxserve.base.paths import RELEASE_ROOT
from hgxserve.release.coordination import Coordination
from hgxserve.remote.inventory import CONNECTION_KEYS

RESULT_DIR = "bench"  # under releases/<id>/ on the gate's host
# Besides the rounds' own time limit: reading releases, opening tunnels, writing the report.
MARGIN_S = 60


@dataclass
class BenchStep:
    """What the deploy knows before the run: the scenario, where the hosts are, and where the
    last confirmed release's result may be kept."""

    topology_file: str
    scenario: str
    timeout_s: int
    max_regression_pct: float | None = None
    tokenizer: str | None = None  # a local tokenizer directory on the controller
    api_key_file: str | None = None  # on the gate's host, read over SSH (never logged)
    metrics_key_file: str | None = None  # the proxy's /metrics key there, read the same way
    connections: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> SSH settings
    previous: tuple[str, str] | None = None  # (host, release id) of the last confirmed gate
    out_root: str = BENCH_RUNS_DIR  # the controller keeps its copy of every run here too


def connection_data(host: Host) -> dict[str, Any]:
    """The SSH settings of a pyinfra host, for `hgxserve.remote.ssh` in the bench process."""
    out = {}
    for key in CONNECTION_KEYS:
        value = host.data.get(key)
        if value is not None:
            out[key] = value
    return out


def previous_gate(states: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(host, release id) whose confirmed (current) release ran the gate, if any."""
    for name, st in sorted(states.items()):
        if st.get("gate_current") and st.get("current"):
            return name, str(st["current"])
    return None


def _inventory_file(directory: Path, connections: dict[str, dict[str, Any]]) -> Path:
    """A pyinfra inventory file with the hosts' SSH settings, for the bench child process."""
    path = directory / "inventory.py"
    hosts = [(name, data) for name, data in sorted(connections.items())]
    path.write_text(f"hosts = {hosts!r}\n")
    path.chmod(0o600)
    return path


def bench_argv(
    step: BenchStep, *, inventory: Path, from_host: str, release_id: str,
    key_files: dict[str, Path | None],
) -> list[str]:  # fmt: skip
    """The bench child's command line: its results go under the step's out_root; `key_files`
    maps a key option (--api-key-file, --metrics-key-file) to the local copy of that key."""
    argv = [
        str(Path(sys.executable).with_name("hgxserve")), "bench", "run", step.topology_file,
        "--scenario", step.scenario, "--inventory", str(inventory), "--from", from_host,
        "--release-id", release_id, "--out", str(Path(step.out_root)),
        "--round-timeout", str(max(1, step.timeout_s - MARGIN_S)),
    ]  # fmt: skip
    for option, path in sorted(key_files.items()):
        if path is not None:
            argv += [option, str(path)]
    if step.tokenizer:
        argv += ["--tokenizer", step.tokenizer]
    return argv


def _runs(out_root: Path) -> set[Path]:
    """The run directories (with a run.json) under `out_root`."""
    return {p.parent for p in out_root.glob("*/run.json")} if out_root.is_dir() else set()


def _read_remote(host: Host, path: str) -> str | None:
    ok, output = host.run_shell_command(f"cat -- {shlex.quote(path)}")
    return "\n".join(output.stdout_lines) if ok else None


def _previous_run(state: State, step: BenchStep, root: str, out: Path) -> Path | None:
    """The last confirmed release's kept run.json, copied here; None when it has none."""
    if step.previous is None:
        return None
    name, release_id = step.previous
    holder = state.inventory.get_host(name, None)
    if holder is None:
        return None
    text = _read_remote(holder, f"{root}/releases/{release_id}/{RESULT_DIR}/run.json")
    if not text:
        return None
    path = out / "previous" / "run.json"
    path.parent.mkdir(parents=True)
    path.write_text(text + "\n")
    return path


def _keep(host: Host, release_id: str, root: str, run_dir: Path) -> str:
    """Keep run.json and report.md beside the release on the gate's host."""
    dest = f"{root}/releases/{release_id}/{RESULT_DIR}"
    host.run_shell_command(f"mkdir -p -- {shlex.quote(dest)}")
    for name in ("run.json", "report.md"):
        source = run_dir / name
        if source.is_file():
            host.put_file(io.BytesIO(source.read_bytes()), f"{dest}/{name}")
    return dest


def _child(argv: list[str], timeout_s: float, host: Host, work: Path) -> tuple[int, list[str]]:
    """Run a bench command, passing its progress (stderr) to the deploy's output as it comes
    (the report it prints on stdout is kept with the run); killed after `timeout_s`."""
    lines: list[str] = []
    with open(work / "bench.stdout", "w", encoding="utf-8") as stdout:
        proc = subprocess.Popen(
            argv, stdout=stdout, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
        )
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                line = line.rstrip("\n")
                lines.append(line)
                if line.strip():
                    host.log_styled(f"bench: {line}")
            code = proc.wait()
        finally:
            timer.cancel()
    if code < 0:
        lines.append(f"error: the bench took longer than gate.bench.timeout_s ({timeout_s:.0f} s)")
    return code, lines


def _failure(code: int, lines: list[str]) -> str:
    misses = [line.removeprefix("SLA missed: ") for line in lines if line.startswith("SLA missed:")]
    if code == 1 and misses:
        return "bench SLA missed: " + "; ".join(misses)
    invalid = [line.removeprefix("INVALID: ") for line in lines if line.startswith("INVALID:")]
    if invalid:
        return "bench INVALID (a P/D round's KV did not all move): " + "; ".join(invalid)
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
    return f"the bench could not run (exit {code}): {errors[-1] if errors else 'no output'}"


def _local_key(host: Host, remote: str | None, local: Path) -> Path | None:
    """A copy (0600) in `local` of the key file `remote` on `host`; None without one;
    KeyError(remote) when it cannot be read."""
    if not remote:
        return None
    key = _read_remote(host, remote)
    if not key:
        raise KeyError(remote)
    local.touch(mode=0o600)
    local.write_text(key.strip() + "\n")
    return local


def run_bench_gate(  # noqa: PLR0913 - pyinfra's python.call: state and host, then its keywords
    state: State, host: Host, coord: Coordination, release_id: str, step: BenchStep,
    root: str = RELEASE_ROOT,
) -> bool:  # fmt: skip
    """python.call on the gate's host after the probes: bench the new release, keep the result
    beside it, and turn a miss or a regression into a failed gate verdict."""
    record = coord.record
    if record.verdict is None or not record.verdict[0]:
        return True  # the probes failed (or did not run): settle reverts without a bench
    with tempfile.TemporaryDirectory(prefix="hgxserve-release-bench-") as tmp:
        work = Path(tmp)
        try:
            key_file = _local_key(host, step.api_key_file, work / "api-key")
            metrics_key = _local_key(host, step.metrics_key_file, work / "metrics-key")
        except KeyError as exc:
            record.verdict = (False, f"bench: cannot read the proxy's key {exc.args[0]}")
            host.log_styled(record.verdict[1], fg="red")
            return True
        inventory = _inventory_file(work, step.connections)
        hosts_ids = " ".join(f"{h}={i}" for h, i in sorted(coord.plan.targets.items()))
        earlier = _runs(Path(step.out_root))
        argv = bench_argv(step, inventory=inventory, from_host=host.name,
                          release_id=hosts_ids or release_id,
                          key_files={"--api-key-file": key_file,
                                     "--metrics-key-file": metrics_key})  # fmt: skip
        host.log_styled(
            f"bench gate: scenario {step.scenario} through the proxy from {host.name} "
            f"(up to {step.timeout_s} s)",
            fg="blue",
        )
        code, lines = _child(argv, step.timeout_s, host, work)
        # a refused or failed run prints no `run:` line but keeps its run.json: the new one
        new = sorted(_runs(Path(step.out_root)) - earlier)
        run_dir = new[-1] if new else None
        if run_dir is not None:
            kept = _keep(host, release_id, root, run_dir)
            host.log_styled(f"bench run kept on {host.name}: {kept}/run.json (here: {run_dir})")
        if code != 0:
            record.verdict = (False, f"gate failed: {_failure(code, lines)}")
            host.log_styled(record.verdict[1], fg="red")
            return True
        if step.max_regression_pct is not None and run_dir is not None:
            _regression(_Gate(state, host, coord, step, root, work), run_dir)
        if record.verdict and record.verdict[0]:
            record.verdict = (True, f"{record.verdict[1]}; bench {step.scenario} met its SLA")
    return True


def _shared_points(old: Path, new: Path) -> set[tuple[str, str]]:
    """(scenario, load) points both runs measured: what `bench compare` can judge."""

    def points(path: Path) -> set[tuple[str, str]]:
        try:
            data = json.loads(path.read_text())
            return {(str(p["scenario"]), str(p["label"])) for p in data.get("points") or []}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return set()

    return points(old) & points(new)


@dataclass
class _Gate:
    """One bench gate on the gate's host: pyinfra's state and host, the release's coordination,
    the bench step, the release root and the gate's scratch directory."""

    state: State
    host: Host
    coord: Coordination
    step: BenchStep
    root: str
    work: Path


def _regression(gate: _Gate, run_dir: Path) -> None:
    """Compare the run with the last confirmed release's kept one; a regression past the step's
    margin fails the gate's verdict."""
    host, record, step = gate.host, gate.coord.record, gate.step
    previous = _previous_run(gate.state, step, gate.root, gate.work)
    if previous is None:
        where = f"{step.previous[0]} release {step.previous[1]}" if step.previous else "none"
        host.log_styled(
            f"bench gate: no kept result of the last confirmed release ({where}): "
            "regression not checked, this run becomes the reference"
        )
        return
    if not _shared_points(previous, run_dir / "run.json"):
        host.log_styled(
            f"bench gate: the kept result of release {step.previous[1] if step.previous else '?'}"
            f" has no point of scenario {step.scenario} at this run's loads: regression not "
            "checked, this run becomes the reference"
        )
        return
    argv = [
        str(Path(sys.executable).with_name("hgxserve")), "bench", "compare",
        str(previous), str(run_dir), "--max-regression", f"{step.max_regression_pct:g}",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=os.environ)
    for line in proc.stdout.splitlines():
        if line.strip():
            host.log_styled(f"bench compare: {line}")
    worse = [ln.removeprefix("regression: ") for ln in proc.stderr.splitlines()
             if ln.startswith("regression: ")]  # fmt: skip
    if proc.returncode == 0:
        return
    if worse:
        why = (
            f"bench regressed more than {step.max_regression_pct:g}% against release "
            f"{step.previous[1] if step.previous else '?'}: " + "; ".join(worse)
        )
    else:
        why = f"bench compare failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    record.verdict = (False, f"gate failed: {why}")
    host.log_styled(record.verdict[1], fg="red")


def bench_step_for(
    topology: Any, topology_file: str, hosts: list[Host], tokenizer: str | None
) -> BenchStep | None:
    """The deploy's bench step for a topology with `gate.bench:` (None without)."""
    from hgxserve.facts.release import ReleaseState
    from hgxserve.release.plan import gate_spec

    gate = topology.gate.bench
    if gate is None:
        return None
    spec = gate_spec(topology) or {}
    states = {h.name: h.get_fact(ReleaseState) for h in hosts}
    return BenchStep(
        topology_file=topology_file,
        scenario=gate.scenario,
        timeout_s=gate.timeout_s,
        max_regression_pct=gate.max_regression_pct,
        tokenizer=tokenizer,
        api_key_file=spec.get("api_key_file"),  # type: ignore[arg-type]
        metrics_key_file=spec.get("metrics_key_file"),  # type: ignore[arg-type]
        connections={h.name: connection_data(h) for h in hosts},
        previous=previous_gate(states),
    )
