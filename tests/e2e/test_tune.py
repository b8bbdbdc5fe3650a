"""`hgxserve tune` end to end on the test hosts: four demo candidates, each deployed through a real
release (the pyinfra CLI, gate included) and benched by a real AIPerf through the real proxy.

The engines are the SIMULATED ones with their speed knob on (testbed/simengine.py
HGXSERVE_SIM_TP_EXPONENT): per-token and prefill time divided by TP^0.8, one forward pass per
engine (prefills one after the other; a decode step waits for the prefill running). Under the
SLA (TTFT p90 <= 1.6 s, TPOT p90 <= 40 ms: the seeds' bar) at concurrency 4, every engine TP2:

- combined (2 GPUs): its decode steps stall behind the other requests' prefills: TPOT misses;
- P/D 1P1D (4 GPUs): the prompts queue on one prefill: TTFT misses;
- P/D 2P1D (6 GPUs): meets both: the winner;
- a P/D candidate whose model config (DeepSeek-V3.2) cannot fit TP2 on H200: pruned, never deployed.

The tune is stopped (SIGTERM to its PID) once the first candidate finished and resumed with
--resume: the finished candidate is not deployed or benched again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from testbed import demo
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
AIPERF_PYTHON = REPO / ".venv-aiperf/bin/python"
HGXSERVE = REPO / ".venv/bin/hgxserve"
DSV32_CONFIG = REPO / "topologies/models/DeepSeek-V3.2/config.json"

HEAD = """\
name: {name}
description: tune e2e candidate {name}
hosts:
  hgx-a: {{address: 10.77.0.11, gpu: H200, gpus: 8}}
  hgx-b: {{address: 10.77.0.12, gpu: H200, gpus: 8}}
  hgx-c: {{address: 10.77.0.13, gpu: H200, gpus: 8}}
model:
  name: tiny
  served_name: tiny
  path: /models/tiny
{config}  source:
    s3:
      endpoint: http://10.77.0.1:9000
      bucket: models
      prefix: tiny/
      addressing: path
      credentials: {{env_file: /etc/hgxserve/s3.env}}
defaults:
  engine: vllm
  version: 0.26.0
  runtime: {{venv: /opt/vllm-sim}}
  args: {{max_model_len: 256, max_num_seqs: 8, block_size: 16}}
  # SIMULATED engine speed (testbed/simengine.py): TP and role matter
  env: {{HGXSERVE_SIM_TP_EXPONENT: "0.8", HGXSERVE_SIM_TOKEN_SECONDS: "0.02",
        HGXSERVE_SIM_PREFILL_SECONDS_PER_1K: "16"}}
accept:
  $.defaults.env.HGXSERVE_SIM_TP_EXPONENT: the SIMULATED engine's speed knob
  $.defaults.env.HGXSERVE_SIM_TOKEN_SECONDS: the SIMULATED engine's time per token
  $.defaults.env.HGXSERVE_SIM_PREFILL_SECONDS_PER_1K: the SIMULATED engine's prefill time
"""
AUTH = """\
  auth:
    api_key: {credential: hgxserve-api-key}
    engine_api_key: {credential: hgxserve-engine-key}
"""
KV = "    kv: {{connector: nixl, side_channel: {{host: auto, port: {port}}}}}\n"

COMBINED = (
    """\
engines:
  combined-0:
    role: combined
    place: {hgx-a: [0, 1]}
    tp: 2
    port: 8100
proxy:
  host: hgx-a
  listen: 0.0.0.0:8000
"""
    + AUTH
    + """\
  combined: [combined-0]
warmup:
  - {input: 128, output: 16, concurrency: 2}
bench:
  drain_timeout_s: 30
  scenarios:
    - name: long
      input: 200
      output: 32
      concurrency: [4]
      requests: 12
      warmup: 4
      seeds: [1]
      sla: {ttft_s: 1.6, tpot_ms: 40}
"""
)


def pd(prefills: int) -> str:
    engines = "engines:\n"
    for i in range(prefills):
        engines += (
            f"  prefill-{i}:\n    role: prefill\n    place: {{hgx-a: [{2 * i}, {2 * i + 1}]}}\n"
            f"    tp: 2\n    port: {8100 + i}\n" + KV.format(port=5600 + i)
        )
    engines += "  decode-0:\n    role: decode\n    place: {hgx-b: [0, 1]}\n    tp: 2\n"
    engines += "    port: 8200\n" + KV.format(port=5600)
    names = ", ".join(f"prefill-{i}" for i in range(prefills))
    return (
        engines
        + "proxy:\n  host: hgx-c\n  listen: 0.0.0.0:8000\n"
        + AUTH
        # every prompt through a prefill (no pd-local): the simulated P/D speeds compare as such
        + "  routing: {policy: least-outstanding}\n"
        + f"  routes:\n    - {{prefill: [{names}], decode: [decode-0]}}\n"
        + "warmup:\n  - {input: 128, output: 16, concurrency: 2}\n"
    )


def write_candidates(d: Path) -> dict[str, Path]:
    bodies = {
        "tune-2p1d": ("", pd(2)),
        "tune-combined": ("", COMBINED),
        "tune-1p1d": ("", pd(1)),
        "tune-fit-reject": (f"  config: {DSV32_CONFIG}\n", pd(1)),
    }
    files = {}
    for name, (config, body) in bodies.items():
        files[name] = d / f"{name}.yml"
        files[name].write_text(HEAD.format(name=name, config=config) + body)
    spec = d / "demo.tune.yaml"
    spec.write_text(
        "base: tune-combined.yml\n"
        "candidates: [tune-2p1d.yml, tune-combined.yml, tune-1p1d.yml, tune-fit-reject.yml]\n"
        f"inventory: {REPO / 'inventory/testhosts.py'}\n"
        "leave: best\n"
        "deploy:\n  stages: [runtime, weights, engines]\n"
        "  data: {health_timeout: 75, confirm_within: 120}\n"
    )
    files["spec"] = spec
    return files


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if not AIPERF_PYTHON.exists():
        pytest.skip("the bench load generator (AIPerf, .venv-aiperf) is missing: scripts/setup.sh")
    for name in testbed.names:
        testbed.ssh(name, demo.FORGET_RELEASES, check=True)
    demo.prepare(testbed.names, tmp_path_factory.mktemp("demo"))
    yield testbed
    demo.stop_s3()
    for name in testbed.names:
        testbed.ssh(name, demo.FORGET_RELEASES)


def tune_argv(spec: Path, out: Path, tokenizer: Path, key: Path, *extra: str) -> list[str]:
    return [str(HGXSERVE), "tune", str(spec), "--out", str(out), "--tokenizer", str(tokenizer),
            "--api-key-file", str(key), *extra]  # fmt: skip


def read_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(run_dir_of, proc: subprocess.Popen, ready, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"tune exited {proc.returncode} early"
        run_dir = run_dir_of()
        state = read_state(run_dir) if run_dir else {}
        if state and ready(state["candidates"]):
            return state
        time.sleep(0.5)
    raise AssertionError("timed out waiting for the tune")


def releases_with(lab: testbed_hosts.Testbed, topology: str) -> list[str]:
    """Every release on every host whose release.json names this topology."""
    found = []
    for host in lab.names:
        out = lab.ssh(
            host, f'grep -l \'"topology": "{topology}"\' /var/lib/hgxserve/releases/*/release.json'
        ).stdout.split()
        found += [f"{host}:{p}" for p in out]
    return found


def test_tune_picks_the_best_under_the_sla_resumes_and_never_deploys_the_pruned(
    lab: testbed_hosts.Testbed, tokenizer: Path, tmp_path: Path
) -> None:
    files = write_candidates(tmp_path)
    out = tmp_path / "runs"
    key = demo.api_key_file(tmp_path)
    argv = tune_argv(files["spec"], out, tokenizer, key)

    def run_dir_of() -> Path | None:
        dirs = sorted(out.iterdir()) if out.is_dir() else []
        return dirs[0] if dirs else None

    t0 = time.monotonic()
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        state = wait_for(
            run_dir_of,
            first,
            lambda c: (
                c.get("tune-2p1d", {}).get("status") == "done"
                and c.get("tune-combined", {}).get("status") == "benching"
            ),
        )
    finally:
        os.kill(first.pid, signal.SIGTERM)  # stop the tune by its PID
        first.wait(60)
    t_first = time.monotonic() - t0
    run_dir = run_dir_of()
    assert run_dir is not None
    first_text = (tmp_path / "first.log").read_text()
    assert first.returncode == 130, first_text[-3000:]
    assert "estimated wall time:" in first_text
    assert "pruned " in first_text and "tune-fit-reject" in first_text
    done = read_state(run_dir)["candidates"]["tune-2p1d"]
    assert done["attempts"] == 1 and done["bench_run"], done

    t1 = time.monotonic()
    second = subprocess.run(
        [*argv, "--resume", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    t_second = time.monotonic() - t1
    text = second.stdout + second.stderr
    state = read_state(run_dir)
    cands = state["candidates"]
    print(f"\ntune: first run {t_first:.0f} s (stopped), resumed run {t_second:.0f} s")
    for name, c in cands.items():
        figures = [(f["ttft_ms"], f["tpot_ms"], f["sla"]) for f in c.get("figures") or []]
        print(name, c["verdict"], c["score"], c["attempts"], c.get("started"), c.get("finished"))
        print("   ", figures)
    for run_json in sorted((run_dir / "bench").glob("*/run.json")):
        bench_run = json.loads(run_json.read_text())
        if not bench_run.get("finished"):
            continue
        took = datetime.fromisoformat(bench_run["finished"]) - datetime.fromisoformat(
            bench_run["started"]
        )
        served = sum(r["client"].get("duration_s") or 0 for r in bench_run["rounds"])
        print(
            f"  bench {bench_run['run_id']}: {took.total_seconds():.1f} s, requests {served:.1f} s"
        )
    assert second.returncode == 0, text[-5000:]

    # resumed without running the finished candidate again: same record, one bench run of it
    assert cands["tune-2p1d"] == done
    bench_runs = sorted(p.name for p in (run_dir / "bench").iterdir())
    assert len([b for b in bench_runs if b.endswith("-tune-2p1d")]) == 1, bench_runs
    assert cands["tune-combined"]["attempts"] == 2  # it was benching when the tune stopped
    assert (run_dir / "deploys" / "tune-2p1d-1.log").is_file()
    assert not (run_dir / "deploys" / "tune-2p1d-2.log").exists()

    # the simulation's verdicts: only the 2P1D meets the SLA
    assert cands["tune-combined"]["verdict"] == "FAIL", cands["tune-combined"]
    assert any("TPOT" in f["sla"] for f in cands["tune-combined"]["figures"]), cands
    assert all("TPOT" not in f["sla"] for f in cands["tune-1p1d"]["figures"]), cands
    assert cands["tune-1p1d"]["verdict"] == "FAIL", cands["tune-1p1d"]
    assert any("TTFT" in f["sla"] for f in cands["tune-1p1d"]["figures"]), cands
    assert cands["tune-2p1d"]["verdict"] == "PASS", cands["tune-2p1d"]
    final = state["final"]
    assert final["winner"] == "tune-2p1d" and final["redeployed"] is True, final

    # the lab runs the winner: each host's current release is the one the tune recorded
    current = {
        h: json.loads(lab.ssh(h, "/opt/hgxserve/bin/hgxserve release status").stdout)["current"]
        for h in lab.names
    }
    assert final["release"] == " ".join(f"{h}={current[h]}" for h in ("hgx-a", "hgx-b", "hgx-c"))
    topo_of = lab.ssh("hgx-c", f"cat /var/lib/hgxserve/releases/{current['hgx-c']}/release.json")
    assert json.loads(topo_of.stdout)["topology"] == "tune-2p1d"

    # the candidate the fit estimate rejects: pruned with its reasons, never released anywhere
    rejected = cands["tune-fit-reject"]
    assert rejected["status"] == "pruned" and rejected["attempts"] == 0
    assert any("(rule fit-weights)" in r for r in rejected["reasons"]), rejected
    assert releases_with(lab, "tune-fit-reject") == []
    assert releases_with(lab, "tune-1p1d"), "the check finds the releases a candidate left"
    assert not list((run_dir / "deploys").glob("tune-fit-reject*"))

    # the report
    report = (run_dir / "report.md").read_text()
    assert "tune-2p1d" in report and "Pruned before any deploy" in report
    doc = json.loads((run_dir / "report.json").read_text())
    assert doc["final"]["winner"] == "tune-2p1d"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (run_dir / "tune.png").stat().st_size > 0
