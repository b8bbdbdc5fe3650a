"""`hgxserve bench` end to end: the demo P/D topology on the test hosts, loaded by a real AIPerf
through the real proxy; the engines are the simulated ones (10 ms per output token).

The tests run in order on one deployment: two scenarios with plots, a leftover client that makes
the next round wait and then refuse, and an SLA tighter than the simulated engine can meet.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import api_request, demo_lab, site

from testbed import demo
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
AIPERF_PYTHON = REPO / ".venv-aiperf/bin/python"
PROXY = "10.77.0.13"


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if not AIPERF_PYTHON.exists():
        pytest.skip("the bench load generator (AIPerf, .venv-aiperf) is missing: scripts/setup.sh")
    with demo_lab(testbed, tmp_path_factory.mktemp("demo")) as bed:
        proc = site(bed, PD)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        yield bed


@pytest.fixture(scope="module")
def combined_url(lab: testbed_hosts.Testbed) -> Iterator[str]:
    """combined-0 listens on hgx-c's loopback only (the proxy fronts it): reach its /metrics
    through an SSH tunnel, as an operator would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = lab.ssh_argv("hgx-c")
    argv[-1:-1] = ["-N", "-L", f"127.0.0.1:{port}:127.0.0.1:8300"]
    tunnel = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        tunnel.terminate()
        tunnel.wait(10)


COMBINED: list[str] = []  # combined-0 through the SSH tunnel, set by each test


def bench(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    if args and args[0] != "compare":  # the demo proxy wants its client key
        key_dir = Path(tempfile.mkdtemp(prefix="bench-key-"))
        args = (*args, "--api-key-file", str(demo.api_key_file(key_dir)))
        if COMBINED:
            args = (*args, f"--engine-url=combined-0={COMBINED[0]}")
    return subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def only_run(out: Path) -> dict:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return json.loads((run_dir / "run.json").read_text())


def sim_requests(address: str, port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://{address}:{port}/sim/requests", timeout=10) as resp:
        return list(json.loads(resp.read())["requests"])


def test_two_scenarios_through_the_proxy_with_plots(
    lab: testbed_hosts.Testbed, tokenizer: Path, tmp_path: Path
) -> None:
    """From hgx-a (the client network, through an SSH tunnel); each engine's /metrics read
    through its own host, combined-0 on hgx-c's loopback included."""
    COMBINED[:] = []
    proc = bench(str(PD), "--scenario", "pd-long", "--scenario", "combined-short",
                 "--tokenizer", str(tokenizer), "--out", str(tmp_path),
                 "--inventory", "inventory/testhosts.py", "--from", "hgx-a")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "proxy: through an SSH tunnel to http://10.77.0.13:8000 from hgx-a" in proc.stderr
    assert "combined-0: through an SSH tunnel to http://127.0.0.1:8300 on hgx-c" in proc.stderr
    run = only_run(tmp_path)
    run_dir = tmp_path / run["run_id"]
    assert run["load_from"] == "hgx-a (SSH tunnel from the controller to http://10.77.0.13:8000)"
    assert run["passed"] is True and run["topology"]["gpus"] == 10  # 4 + 4 + 2
    assert run["topology"]["digest"]
    current = {
        h: json.loads(lab.ssh(h, "/opt/hgxserve/bin/hgxserve release status").stdout)["current"]
        for h in ("hgx-a", "hgx-b", "hgx-c")
    }  # the release each host runs, read over SSH with the inventory
    assert run["release_id"] == " ".join(f"{h}={r}" for h, r in current.items()), run
    assert all(current.values())
    assert set(run["engine_versions"]) == {"prefill-0", "decode-0", "combined-0"}
    assert [(p["scenario"], p["label"]) for p in run["points"]] == [
        ("pd-long", "c1"), ("pd-long", "c4"), ("combined-short", "c1"), ("combined-short", "c4"),
    ]  # fmt: skip
    for r in run["rounds"]:
        warmups = 1 if r["point"] == "c1" else 4  # as many as the concurrency
        # measured requests + warm-ups, every one finished by an engine
        assert r["sent"] == r["engines_finished"] == 16 + warmups
        assert r["client"]["requests"] == 16
    long_c4 = next(r for r in run["rounds"] if r["label"] == "pd-long-c4-s1")
    roles = long_c4["engines"]["roles"]
    assert roles["decode"]["kv_transfers"] > 0 and roles["decode"]["kv_transfer_failures"] == 0
    assert roles["prefill"]["prefill_tok_s_per_gpu"] > 0
    assert long_c4["engines"]["engines"]["combined-0"]["requests_finished"] == 0
    short_c4 = next(r for r in run["rounds"] if r["label"] == "combined-short-c4-s1")
    assert short_c4["engines"]["engines"]["decode-0"]["requests_finished"] == 0
    # the simulated engine spends 10 ms per token: TPOT as the client saw it
    assert 8 < long_c4["client"]["tpot_ms_p50"] < 40
    # every request of the round reached the decode with the round's id prefix
    ids = [r["request_id"] for r in sim_requests("10.77.0.12", 8200)]
    assert sum(i.startswith(long_c4["request_id_prefix"] + "-") for i in ids) == long_c4["sent"]
    for name in ("throughput.png", "ttft.png", "tpot.png"):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG"
    assert "![ttft](ttft.png)" in (run_dir / "report.md").read_text()
    # the kept run compares with itself: zero deltas
    again = bench("compare", str(run_dir), str(run_dir))
    assert again.returncode == 0 and "(+0.0%)" in again.stdout


PREFILL_UNIT = "hgxserve-prefill-0.service"
FAIL_DROPIN = f"/run/systemd/system/{PREFILL_UNIT}.d/simulated-failure.conf"


def _prefill_healthy(timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen("http://10.77.0.11:8100/health", timeout=3).read()
            time.sleep(3)  # the proxy's health check puts it back in rotation
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _fidelity_round(tokenizer: Path, out: Path) -> subprocess.CompletedProcess:
    return bench(str(PD), "--scenario", "seed003-long", "--tokenizer", str(tokenizer),
                 "--out", str(out), "--inventory", "inventory/testhosts.py",
                 "--from", "hgx-a")  # fmt: skip


def test_a_valid_pd_round_with_gpu_telemetry(
    lab: testbed_hosts.Testbed, tokenizer: Path, tmp_path: Path
) -> None:
    """Seed 003's 4K/128 at C4 scaled to the tiny model: every KV moved, so the round is valid
    evidence; nvidia-smi on every host (over SSH) sampled during the round."""
    COMBINED[:] = []
    proc = _fidelity_round(tokenizer, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert run["verdict"] == "PASS" and run["scenario_verdicts"] == {"seed003-long": "PASS"}
    (r,) = run["rounds"]
    assert r["valid"] is True and r["kv"]["failed_transfers"] == 0
    # every request handed its KV over, or was sent to the decode alone by the KV-aware
    # proxy because its prompt was cached there (pd-local: policy, not a lost transfer)
    assert r["kv"]["handoffs"]["ok"] > 0
    assert r["kv"]["handoffs"]["ok"] + r["kv"]["pd_local_requests"] == r["sent"] == 16 + 4
    tele = r["telemetry"]
    assert tele["source"] == "nvidia-smi" and tele["errors"] == [], tele
    assert set(tele["hosts"]) == {"hgx-a", "hgx-b", "hgx-c"}
    for host, h in tele["hosts"].items():
        assert h["gpus"] == 8 and h["samples"] >= 8, (host, h)
        # each host runs a simulated engine holding GPU memory: its GPUs read busy
        assert h["memory_used_mib"]["max"] > 0 and h["util_pct"]["max"] == 40, (host, h)
        assert 0 < h["power_w"]["min"] <= h["power_w"]["mean"] <= h["power_w"]["max"] <= 700
    for host, h in tele["hosts"].items():
        print(f"{host}: {h['samples']} samples, memory MiB {h['memory_used_mib']}, "
              f"power W {h['power_w']}, util % {h['util_pct']}")  # fmt: skip
    print(f"kv: {r['kv']}, client TTFT/TPOT p95 {r['client']['ttft_ms_p95']:.1f} / "
          f"{r['client']['tpot_ms_p95']:.1f} ms")  # fmt: skip
    point = run["points"][0]
    assert point["telemetry"]["hosts"]["hgx-b"]["samples"] == tele["hosts"]["hgx-b"]["samples"]
    text = (tmp_path / run["run_id"] / "report.md").read_text()
    assert "| seed003-long | c4 | PASS |" in text and "## GPU telemetry" in text
    assert "| seed003-long | c4 | hgx-b | 8 |" in text
    for name in ("pareto-seed003-long.png", "latency-seed003-long.png", "plots.json"):
        assert (tmp_path / run["run_id"] / name).is_file()


def test_a_pd_round_whose_kv_transfers_fail_is_invalid(
    lab: testbed_hosts.Testbed, tokenizer: Path, tmp_path: Path
) -> None:
    """The prefill's NIXL side channel on loopback (seed 003 §11.3): the decode on hgx-b cannot
    pull, recomputes every prompt, and answers 200; the round meets its SLA and is INVALID."""
    COMBINED[:] = []
    dropin = (
        f"mkdir -p {Path(FAIL_DROPIN).parent} && printf '%s\\n' '[Service]' "
        "'Environment=HGXSERVE_SIM_FAIL=loopback_side_channel' > "
        f"{FAIL_DROPIN} && systemctl daemon-reload && systemctl restart {PREFILL_UNIT}"
    )
    lab.ssh("hgx-a", dropin, check=True)
    try:
        _prefill_healthy()
        proc = _fidelity_round(tokenizer, tmp_path)
    finally:
        lab.ssh("hgx-a", f"rm -f {FAIL_DROPIN}; systemctl daemon-reload; "
                f"systemctl restart {PREFILL_UNIT}")  # fmt: skip
        _prefill_healthy()
    assert proc.returncode == 6, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "INVALID: seed003-long c4: seed003-long-c4-s1:" in proc.stderr, proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert run["verdict"] == "INVALID" and run["verdicts"] == []  # the SLA alone would pass
    (r,) = run["rounds"]
    assert r["valid"] is False and r["sent"] == r["engines_finished"] == 16 + 4
    # every request's pull failed, but for those the KV-aware proxy sent to the decode alone
    assert r["kv"]["failed_transfers"] > 0
    assert r["kv"]["failed_transfers"] + r["kv"]["pd_local_requests"] == r["sent"]
    assert r["kv"]["decode_recomputed_tokens"] > 0
    assert r["telemetry"]["source"] == "nvidia-smi"
    print(f"INVALID round: kv {r['kv']}, SLA verdicts {run['points'][0]['verdicts']}")


def test_a_leftover_client_makes_the_round_wait_then_refuse(
    lab: testbed_hosts.Testbed, combined_url: str, tokenizer: Path, tmp_path: Path
) -> None:
    COMBINED[:] = [combined_url]
    stop = threading.Event()

    def leftover_client() -> None:  # seed 003 §11.4: a client from an earlier round
        body = {
            "model": "tiny",
            "prompt": "a leftover client",
            "max_tokens": 150,
            "ignore_eos": True,
        }
        while not stop.is_set():
            req = api_request(f"http://{PROXY}:8000/v1/completions", body)
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()

    threads = [threading.Thread(target=leftover_client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        started = time.monotonic()
        proc = bench(str(PD), "--scenario", "pd-long", "--tokenizer", str(tokenizer),
                     "--out", str(tmp_path), "--drain-timeout", "6")  # fmt: skip
        waited = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "waiting up to 6 s for proxy outstanding 2" in proc.stderr, proc.stderr
    assert "refused: still busy after 6 s: proxy outstanding 2" in proc.stderr, proc.stderr
    assert "combined-0 running 2" in proc.stderr
    assert waited >= 6
    run = only_run(tmp_path)
    assert run["rounds"] == [] and "refused" in run["refused"] and run["passed"] is False


def test_an_sla_the_engine_cannot_meet_exits_1_naming_the_figure(
    lab: testbed_hosts.Testbed, combined_url: str, tokenizer: Path, tmp_path: Path
) -> None:
    COMBINED[:] = [combined_url]
    topology = tmp_path / "demo-pd.yml"
    shutil.copy(PD, topology)
    (tmp_path / "demo-pd.bench.yaml").write_text(
        "bench:\n"
        "  scenarios:\n"
        "    - {name: tight, input: 240, output: 16, concurrency: [2], requests: 8,\n"
        "       sla: {ttft_s: 3, tpot_ms: 2}}\n"  # 2 ms per token: the simulated engine takes 10
    )
    proc = bench(str(topology), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "runs"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SLA missed: tight c2: TPOT p90" in proc.stderr and "SLA <= 2 ms" in proc.stderr
    assert "TTFT" not in proc.stderr.split("SLA missed:", 1)[1]  # the TTFT target was met
    run = only_run(tmp_path / "runs")
    assert run["passed"] is False
    assert [v["figure"] for v in run["verdicts"]] == ["TPOT p90"]


TIGHT = (
    "bench:\n"
    "  scenarios:\n"
    "    - {name: tight, input: 240, output: 16, concurrency: [2], requests: 8,\n"
    "       sla: {ttft_s: 3, tpot_ms: 2}}\n"  # 2 ms per token: the simulated engine takes 10
)


def _releases(lab: testbed_hosts.Testbed) -> dict[str, dict]:
    return {
        h: json.loads(lab.ssh(h, "/opt/hgxserve/bin/hgxserve release status").stdout)
        for h in ("hgx-a", "hgx-b", "hgx-c")
    }


def test_the_same_sla_in_a_release_rolls_it_back(
    lab: testbed_hosts.Testbed, tokenizer: Path, tmp_path: Path
) -> None:
    """`gate.bench:` names the too-tight scenario: the release switches, its probes pass, the
    bench (from the gate's host, hgx-c, each engine's /metrics through its own host) misses
    TPOT, and every host goes back to the running demo-pd release."""
    before = _releases(lab)
    topology = tmp_path / "demo-pd-sla.yml"
    topology.write_text(
        PD.read_text() + TIGHT + "gate:\n  bench: {scenario: tight, max_regression_pct: 50}\n"
    )
    proc = lab.pyinfra(
        "deploys/engines.py", "--data", f"topology={topology}",
        "--data", f"bench_tokenizer={tokenizer}", "--data", "health_timeout=75",
        "--data", "confirm_within=120",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "bench: SLA missed: tight c2: TPOT p90" in out, out[-4000:]
    for host in ("hgx-a", "hgx-b", "hgx-c"):  # every switched host names the failing figure
        assert re.search(
            rf"{host}.*rolled back to the previous release: gate failed: bench SLA missed: "
            r"tight c2: TPOT p90 [\d.]+ ms, SLA <= 2 ms",
            out,
        ), out[-4000:]
    assert "combined-0: through an SSH tunnel to http://127.0.0.1:8300 on hgx-c" in out
    after = _releases(lab)
    assert {h: s["current"] for h, s in after.items()} == {
        h: s["current"] for h, s in before.items()
    }
    assert all(s["pending"] is None for s in after.values())
    # the failed release's result is kept beside it on the gate's host
    kept = lab.ssh("hgx-c", "cat /var/lib/hgxserve/releases/*/bench/run.json").stdout
    run = json.loads(kept)
    assert run["passed"] is False and [v["figure"] for v in run["verdicts"]] == ["TPOT p90"]
    assert run["load_from"].startswith("hgx-c (SSH tunnel") and run["release_id"].count("=") == 3
    assert before["hgx-c"]["current"] not in run["release_id"]
