"""`hgxserve bench` on 127.0.0.1: a real AIPerf through a real `hgxserve proxy serve` in front of
simulated prefill, decode and combined engines (10 ms per output token), no test hosts needed.

The demo P/D topology names the scenarios; --proxy-url and --engine-url point the bench at the
local processes. The same flow runs on the test hosts in tests/e2e/test_bench.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
SIMENGINE = REPO / "testbed/simengine.py"
AIPERF_PYTHON = REPO / ".venv-aiperf/bin/python"
HGXSERVE = Path(sys.executable).with_name("hgxserve")

pytestmark = pytest.mark.skipif(
    not AIPERF_PYTHON.exists(), reason="the bench load generator is missing: scripts/setup.sh"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Lab:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: dict[str, str] = {}
        self.proxy = ""

    def start(self, cmd: list[str], env: dict[str, str], log: str) -> None:
        out = (self.work / log).open("wb")
        self.procs.append(
            subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)  # noqa: S603
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def local_lab(
    work: Path, env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None
) -> Iterator[Lab]:
    """Simulated prefill, decode and combined engines on 127.0.0.1 (10 ms per output token)
    behind a real `hgxserve proxy serve`, and the tiny model's tokenizer for AIPerf; `env` goes
    to every process, `decode_env` to the decode alone."""
    lab = Lab(work)
    env = {
        **os.environ,
        "HGXSERVE_SIM_START_SECONDS": "0",
        "HGXSERVE_SIM_TOKEN_SECONDS": "0.01",
        "HGXSERVE_SIM_GPU_DIR": str(work / "gpus"),
        **(env or {}),
    }
    producer = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    consumer = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    engines = {
        "prefill-0": ({}, ["--kv-transfer-config", producer]),
        "decode-0": (decode_env or {}, ["--kv-transfer-config", consumer]),
        "combined-0": ({}, []),
    }  # fmt: skip
    try:
        for name, (extra_env, extra) in engines.items():
            port = free_port()
            eng_env = {
                **env,
                **extra_env,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            }
            lab.start(
                [sys.executable, str(SIMENGINE), "--engine", "vllm", "serve", "/models/tiny",
                 "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                 "--max-model-len", "256", "--max-num-seqs", "8", *extra],
                eng_env, f"{name}.log",
            )  # fmt: skip
            lab.urls[name] = f"http://127.0.0.1:{port}"
        for url in lab.urls.values():
            wait_http(url + "/health")
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "protocol": "vllm-nixl",
            "served_model_name": "tiny",
            "pd_groups": [{"prefill": [lab.urls["prefill-0"]], "decode": [lab.urls["decode-0"]]}],
            "combined": [lab.urls["combined-0"]],
            "routing": {"pd_min_prompt_tokens": 64},
            "health": {"interval_s": 1},
        }
        (work / "proxy.json").write_text(json.dumps(config))
        lab.start([str(HGXSERVE), "proxy", "serve", "--config", str(work / "proxy.json")],
                  env, "proxy.log")  # fmt: skip
        lab.proxy = f"http://127.0.0.1:{port}"
        wait_http(lab.proxy + "/health")
        tok = work / "tokenizer"
        subprocess.run(
            [str(AIPERF_PYTHON), str(REPO / "testbed/tiny_llama.py"), "--tokenizer-only",
             str(tok)], check=True, capture_output=True,
        )  # fmt: skip
        yield lab
    finally:
        lab.stop()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with local_lab(tmp_path_factory.mktemp("bench-lab")) as the_lab:
        yield the_lab


def bench(lab: Lab, topology: Path, *args: str) -> subprocess.CompletedProcess[str]:
    urls = [f"--engine-url={n}={u}" for n, u in lab.urls.items()]
    return subprocess.run(
        [str(HGXSERVE), "bench", str(topology), "--proxy-url", lab.proxy, *urls,
         "--tokenizer", str(lab.work / "tokenizer"), *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def topology_with(tmp_path: Path, bench_yaml: str) -> Path:
    topology = tmp_path / "demo-pd.yml"
    shutil.copy(PD, topology)
    (tmp_path / "demo-pd.bench.yaml").write_text(bench_yaml)
    return topology


def only_run(out: Path) -> dict:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return dict(json.loads((run_dir / "run.json").read_text()))


def bench_round(
    lab: Lab, tmp_path: Path, bench_yaml: str, returncode: int, *args: str
) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    """`bench` of the demo topology with `bench_yaml` into tmp_path/runs, which exits
    `returncode`: the process, its one run's run.json, and the runs folder."""
    out = tmp_path / "runs"
    proc = bench(lab, topology_with(tmp_path, bench_yaml), "--out", str(out), *args)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, only_run(out), out


def sim_ids(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/sim/requests", timeout=10) as resp:
        return [r["request_id"] for r in json.loads(resp.read())["requests"]]


def test_pd_and_combined_scenarios_pass_with_clean_rounds_and_plots(
    lab: Lab, tmp_path: Path
) -> None:
    proc, run, out = bench_round(
        lab,
        tmp_path,
        "bench:\n  drain_timeout_s: 10\n  scenarios:\n"
        "    - {name: pd-long, input: 240, output: 16, concurrency: [2], requests: 8,\n"
        "       sla: {ttft_s: 3, tpot_ms: 40}}\n"
        "    - {name: short, input: 24, output: 16, concurrency: [2], requests: 8}\n",
        0,
        "--release-id",
        "r-local",
    )
    assert run["passed"] is True and run["refused"] is None
    assert run["release_id"] == "r-local" and run["topology"]["gpus"] == 10
    assert run["engine_versions"]["decode-0"] == "vllm 0.0.0+simulated"
    long_round, short_round = run["rounds"]
    for r in run["rounds"]:
        assert r["sent"] == r["engines_finished"] == 8 + 2  # measured + warm-ups
        assert r["client"]["requests"] == 8
        assert 8 < r["client"]["tpot_ms_p50"] < 40  # 10 ms per token in the engine
    roles = long_round["engines"]["roles"]
    assert roles["decode"]["kv_transfers"] == 10 and roles["decode"]["kv_transfer_failures"] == 0
    assert roles["prefill"]["prefill_tok_s_per_gpu"] > 0
    assert long_round["engines"]["engines"]["decode-0"]["prompt_tokens_computed"] == 0
    assert short_round["engines"]["engines"]["combined-0"]["requests_finished"] == 10
    assert short_round["engines"]["engines"]["decode-0"]["requests_finished"] == 0
    ids = sim_ids(lab.urls["decode-0"])
    prefix = long_round["request_id_prefix"] + "-"
    assert sum(i.startswith(prefix) for i in ids) == 10
    assert sum(i.startswith(prefix) for i in sim_ids(lab.urls["prefill-0"])) == 10
    run_dir = out / run["run_id"]
    for name in ("throughput.png", "ttft.png", "tpot.png"):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG"
    assert "PASS" in (run_dir / "report.md").read_text()
    again = subprocess.run([str(HGXSERVE), "bench", "compare", str(run_dir), str(run_dir)],
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 0 and "(+0.0%)" in again.stdout


def test_a_leftover_client_makes_the_round_wait_then_refuse(lab: Lab, tmp_path: Path) -> None:
    topology = topology_with(
        tmp_path,
        "bench:\n  scenarios:\n    - {name: pd-long, input: 128, output: 16, concurrency: [2]}\n",
    )
    stop = threading.Event()

    def leftover_client() -> None:  # seed 003 §11.4: a client from an earlier round
        # a request lasts ~2 s (200 tokens), so a loaded machine rarely catches a client
        # between two requests and counts 1 outstanding
        body = json.dumps({"model": "tiny", "prompt": "a leftover client", "max_tokens": 200,
                           "ignore_eos": True}).encode()  # fmt: skip
        while not stop.is_set():
            req = urllib.request.Request(
                lab.proxy + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()

    threads = [threading.Thread(target=leftover_client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        proc = bench(lab, topology, "--out", str(tmp_path / "runs"), "--drain-timeout", "3")
        waited = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pd-long-c2-s0: waiting up to 3 s for proxy outstanding 2" in proc.stderr
    assert "refused: still busy after 3 s: proxy outstanding 2, combined-0 running 2" in (
        proc.stderr
    )
    assert waited >= 3
    run = only_run(tmp_path / "runs")
    assert run["rounds"] == [] and "still busy" in run["refused"] and run["passed"] is False


def test_an_sla_the_engine_cannot_meet_exits_1_naming_the_figure(lab: Lab, tmp_path: Path) -> None:
    topology = topology_with(
        tmp_path,
        "bench:\n  scenarios:\n"
        "    - {name: tight, input: 128, output: 16, concurrency: [2], requests: 6,\n"
        "       sla: {ttft_s: 3, tpot_ms: 2}}\n",  # 2 ms per token: the engine takes 10
    )
    proc = bench(lab, topology, "--out", str(tmp_path / "runs"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SLA missed: tight c2: TPOT p90" in proc.stderr and "SLA <= 2 ms" in proc.stderr
    run = only_run(tmp_path / "runs")
    assert run["passed"] is False
    assert [v["figure"] for v in run["verdicts"]] == ["TPOT p90"]
