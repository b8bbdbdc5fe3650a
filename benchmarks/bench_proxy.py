"""Proxy overhead, measured in one run on 127.0.0.1 against the same simulated engines.

Compares, at concurrency 1, 64 and 512 (non-streaming /v1/completions, 8 output tokens, engines
with zero simulated compute so the proxy is what is measured):
  direct    client -> decode engine (no proxy, no prefill hop: the floor)
  hgxserve  client -> `hgxserve proxy serve` -> prefill, then decode (vLLM NIXL protocol;
            routing policy least-outstanding, the default)
  hgxserve-kv  the same proxy with routing policy kv-events and a tokenizer: every prompt is
            tokenized (a byte-level BPE with a 32,000-token vocabulary and a Llama-3-style chat
            template, trained here as benchmarks/bench_kv_index.py does) and matched against
            the KV index; pd_remote_prefill_min_uncached_tokens 0 so that every request still
            takes the prefill-then-decode path of the other targets (the simulated engines here
            publish no KV events: the index stays empty, event ingestion is not measured)
  vllm-router  client -> `vllm-router --vllm-pd-disaggregation --policy round_robin` -> prefill,
            then decode
  vllm-router-cache  the same with `--policy cache_aware` (its prefix-tree router: the
            cache-aware counterpart of hgxserve-kv)
  toy-proxy client -> an equivalent of vLLM's example proxy (toy_proxy_server.py architecture:
            FastAPI + uvicorn + httpx.AsyncClient, benchmarks/baselines/toy_pd_proxy.py)
            -> prefill, then decode

    .venv/bin/python benchmarks/bench_proxy.py                       # hgxserve vs direct
    .venv/bin/python benchmarks/bench_proxy.py --vllm-router /tmp/vr/venv/bin/vllm-router \
        --toy-proxy-python /tmp/toyproxy/venv/bin/python

To compare with an earlier hgxserve revision in the same run (target `hgxserve@base`):
    mkdir /tmp/base && git archive <rev> hgxserve files schemas | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_proxy.py --baseline-tree /tmp/base

Scratch venvs for the two baselines (kept out of the project's dependencies):
    python3 -m venv /tmp/vr/venv && /tmp/vr/venv/bin/pip install vllm-router==0.1.17
    python3 -m venv /tmp/toyproxy/venv && /tmp/toyproxy/venv/bin/pip install \
        fastapi==0.165.0 uvicorn==0.54.0 httpx==0.28.1 uvloop==0.23.0 httptools==0.9.0

Prints, per target and concurrency: p50/p99/mean latency, latency added over direct
(p50/p99), req/s, errors, and the proxy process's CPU time per request (user+sys from
/proc/<pid>/stat), pooled over --rounds rounds in which the targets take turns (so load from
elsewhere hits all of them alike). Then the tokenizer's share of hgxserve-kv's CPU: the
benchmark's own prompt tokenized here, in this process, with the proxy's PromptTokenizer
(CPU time per call: back to back, and 1 ms apart as at C=1, where caches are cold), over
hgxserve-kv's CPU per request; and hgxserve-kv's CPU over hgxserve's (least-outstanding) in the
same run: the tokenizer and the KV decision together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from benchlib import baseline_command, free_port, pct, wait_http

ROOT = Path(__file__).resolve().parents[1]
SIMENGINE = ROOT / "testbed" / "simengine.py"
TOY_PROXY = ROOT / "benchmarks" / "baselines" / "toy_pd_proxy.py"
HGXSERVE = Path(sys.executable).with_name("hgxserve")
CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = {
    "model": "m",
    "prompt": "benchmark prompt " * 16,
    "max_tokens": 8,
    "ignore_eos": True,
    "temperature": 0,
}


def kv_tokenizer(directory: Path) -> None:
    """The tokenizer hgxserve-kv loads: bench_kv_index's BPE, trained on this repository."""
    from bench_kv_index import build_tokenizer, corpus

    build_tokenizer(directory, corpus())


def tokenize_ms(directory: Path) -> tuple[float, float, int]:
    """CPU ms of one tokenization of the benchmark's prompt: back to back (warm caches) and
    with 1 ms asleep between calls (as at C=1: the sleep's own CPU subtracted), each the least
    of 3 rounds; and the prompt's token count."""
    from hgxserve.proxy.tokens import PromptTokenizer

    tok = PromptTokenizer.load(str(directory))

    def per_call(n: int, nap: float, work: bool) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for _ in range(n):
                if work:
                    tok.prompt_ids(BODY, "completion")
                if nap:
                    time.sleep(nap)
            best = min(best, (time.process_time() - t0) / n)
        return best * 1e3

    warm = per_call(2000, 0, True)
    spaced = per_call(300, 0.001, True) - per_call(300, 0.001, False)
    return warm, spaced, len(tok.prompt_ids(BODY, "completion"))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


async def load(url: str, concurrency: int, total: int) -> tuple[list[float], int, float]:
    body = BODY
    latencies: list[float] = []
    errors = 0
    left = total
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
    return latencies, errors, wall


def start_proxy(
    command: list[str],
    config: dict[str, Any],
    work: Path,
    name: str,
    env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> subprocess.Popen[bytes]:
    """`<command> proxy serve` with `config` (added to `procs`), once it answers /health."""
    (work / f"{name}.json").write_text(json.dumps(config))
    cmd = [*command, "proxy", "serve", "--config", str(work / f"{name}.json")]
    proc = start([*cmd, "--log-level", "warning"], env, work / f"{name}.log")
    procs.append(proc)
    wait_http(f"http://127.0.0.1:{config['listen']['port']}/health")
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-router", help="path to the vllm-router executable (PyPI vllm-router)")
    ap.add_argument(
        "--toy-proxy-python",
        help="python of a venv with fastapi, httpx, uvicorn: runs the example-proxy equivalent",
    )
    ap.add_argument("--baseline-tree", help="also run hgxserve from this source tree")
    ap.add_argument("--concurrency", default="1,64,512")
    ap.add_argument(
        "--requests", default="1000,2000,2048", help="requests per concurrency level and round"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds per level; targets take turns each round"
    )
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    env = {
        **os.environ,
        "HGXSERVE_SIM_START_SECONDS": "0.2",
        "HGXSERVE_SIM_TOKEN_SECONDS": "0",
        "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": "0",
        "HGXSERVE_SIM_GPU_DIR": str(work / "gpus"),
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        names = ("prefill", "decode", "hgxserve", "kv", "base", "base-kv", "toy")
        ports = {k: free_port() for k in (*names, "vllm-router", "vllm-router-cache")}
        tok_dir = work / "tokenizer"
        tok_dir.mkdir()
        kv_tokenizer(tok_dir)
        for role, kv in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            eng_env = {
                **env,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            }
            cmd = [
                sys.executable,
                str(SIMENGINE),
                "--engine",
                "vllm",
                "serve",
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                str(ports[role]),
                "--max-num-seqs",
                "1024",
                "--kv-transfer-config",
                json.dumps({"kv_connector": "NixlConnector", "kv_role": kv}),
            ]
            procs.append(start(cmd, eng_env, work / f"{role}.log"))
        prefill_url = f"http://127.0.0.1:{ports['prefill']}"
        decode_url = f"http://127.0.0.1:{ports['decode']}"
        wait_http(prefill_url + "/health")
        wait_http(decode_url + "/health")
        targets: dict[str, tuple[str, int | None]] = {"direct": (decode_url, None)}
        config = {
            "listen": {"host": "127.0.0.1", "port": ports["hgxserve"]},
            "protocol": "vllm-nixl",
            "served_model_name": "m",
            "pd_groups": [{"prefill": [prefill_url], "decode": [decode_url]}],
            # a generous health timeout: on a loaded 2-core machine a 2 s check can miss and
            # eject an engine mid-run (all proxies get the same configuration)
            "health": {"interval_s": 5, "timeout_s": 10},
        }
        px = start_proxy([str(HGXSERVE)], config, work, "hgxserve", env, procs)
        targets["hgxserve"] = (f"http://127.0.0.1:{ports['hgxserve']}", px.pid)
        kv_config = {
            **config,
            "listen": {"host": "127.0.0.1", "port": ports["kv"]},
            "routing": {
                "policy": "kv-events",
                "tokenizer_dir": str(tok_dir),
                "pd_remote_prefill_min_uncached_tokens": 0,
            },
        }
        kp = start_proxy([str(HGXSERVE)], kv_config, work, "hgxserve-kv", env, procs)
        targets["hgxserve-kv"] = (f"http://127.0.0.1:{ports['kv']}", kp.pid)
        if args.baseline_tree:
            base_cfg = {**config, "listen": {"host": "127.0.0.1", "port": ports["base"]}}
            bp = start_proxy(
                baseline_command(args.baseline_tree), base_cfg, work, "base", env, procs
            )
            targets["hgxserve@base"] = (f"http://127.0.0.1:{ports['base']}", bp.pid)
            base_kv = {**kv_config, "listen": {"host": "127.0.0.1", "port": ports["base-kv"]}}
            bk = start_proxy(
                baseline_command(args.baseline_tree), base_kv, work, "base-kv", env, procs
            )
            targets["hgxserve-kv@base"] = (f"http://127.0.0.1:{ports['base-kv']}", bk.pid)
        router_note = "not run (pass --vllm-router PATH)"
        if args.vllm_router:
            router_note = "run"
            for name, policy in (
                ("vllm-router", "round_robin"),
                ("vllm-router-cache", "cache_aware"),
            ):
                rt = start(
                    [
                        args.vllm_router,
                        "--vllm-pd-disaggregation",
                        "--prefill",
                        prefill_url,
                        "--decode",
                        decode_url,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(ports[name]),
                        "--policy",
                        policy,
                        # each its own metrics port (both would take 29000)
                        "--prometheus-port",
                        str(free_port()),
                    ],
                    env,
                    work / f"{name}.log",
                )
                procs.append(rt)
                try:
                    wait_http(f"http://127.0.0.1:{ports[name]}/health", 60)
                    targets[name] = (f"http://127.0.0.1:{ports[name]}", rt.pid)
                except SystemExit:
                    router_note = f"{name} failed to start: see {work / (name + '.log')}"
        toy_note = "not run (pass --toy-proxy-python PATH)"
        if args.toy_proxy_python:
            toy = start(
                [
                    args.toy_proxy_python,
                    str(TOY_PROXY),
                    "--port",
                    str(ports["toy"]),
                    "--prefill",
                    prefill_url,
                    "--decode",
                    decode_url,
                ],
                env,
                work / "toy-proxy.log",
            )
            procs.append(toy)
            try:
                wait_http(f"http://127.0.0.1:{ports['toy']}/healthcheck", 60)
                targets["toy-proxy"] = (f"http://127.0.0.1:{ports['toy']}", toy.pid)
                toy_note = "run"
            except SystemExit:
                toy_note = f"failed to start: see {work / 'toy-proxy.log'}"
        rows: list[dict[str, Any]] = []
        base: dict[int, tuple[float, float]] = {}
        for conc, total in zip(levels, counts, strict=True):
            for url, _ in targets.values():
                asyncio.run(load(url, min(conc, 16), min(total, 100)))  # warm up pools
            # targets take turns, round after round, so that a burst of other load on the
            # machine falls on all of them rather than on one
            runs: dict[str, list[tuple[list[float], int, float, float]]] = {n: [] for n in targets}
            for _ in range(args.rounds):
                for name, (url, pid) in targets.items():
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    lat, errors, wall = asyncio.run(load(url, conc, total))
                    cpu = (cpu_seconds(pid) - cpu0) if pid else float("nan")
                    runs[name].append((lat, errors, wall, cpu))
            for name, parts in runs.items():
                lat = [x for p in parts for x in p[0]]
                errors = sum(p[1] for p in parts)
                wall = sum(p[2] for p in parts)
                cpu = sum(p[3] for p in parts)
                p50, p99 = pct(lat, 0.50), pct(lat, 0.99)
                if name == "direct":
                    base[conc] = (p50, p99)
                rows.append(
                    {
                        "target": name,
                        "c": conc,
                        "n": total * args.rounds,
                        "p50": p50,
                        "p99": p99,
                        "mean": sum(lat) / max(1, len(lat)),
                        "add50": p50 - base[conc][0],
                        "add99": p99 - base[conc][1],
                        "rps": len(lat) / wall,
                        "errors": errors,
                        "cpu_ms": cpu / max(1, len(lat)) * 1000,
                    }
                )
        # evidence that the P/D path really moved KV (not a silent local recompute)
        import urllib.request

        with urllib.request.urlopen(decode_url + "/metrics") as r:
            text = r.read().decode()
        xfers = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:nixl_xfer_time_seconds_count")
        )
        with urllib.request.urlopen(targets["hgxserve-kv"][0] + "/metrics") as r:
            kv_text = r.read().decode()
        matched = [
            line for line in kv_text.splitlines() if line.startswith("hgxserve_proxy_prompt_match")
        ]
        fails = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:nixl_num_failed_transfers_total")
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    print(
        f"\nproxy overhead on 127.0.0.1 (simulated engines, {os.cpu_count()} CPUs); "
        f"vllm-router: {router_note}; toy-proxy: {toy_note}"
    )
    head = (
        f"{'target':<14}{'C':>5}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'+p50 ms':>9}"
        f"{'+p99 ms':>9}{'req/s':>9}{'err':>5}{'CPU ms/req':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['target']:<14}{r['c']:>5}{r['n']:>6}{r['p50'] * 1e3:>9.2f}{r['p99'] * 1e3:>9.2f}"
            f"{r['mean'] * 1e3:>9.2f}"
            f"{r['add50'] * 1e3:>9.2f}{r['add99'] * 1e3:>9.2f}{r['rps']:>9.0f}{r['errors']:>5}"
            f"{r['cpu_ms']:>11.3f}"
        )
    warm, spaced, tok_n = tokenize_ms(tok_dir)
    print(
        f"tokenizer: the prompt ({tok_n} tokens) costs {warm:.4f} CPU ms per tokenization back "
        f"to back, {spaced:.4f} with 1 ms between calls"
    )
    least = {(r["target"].replace("hgxserve", ""), r["c"]): r["cpu_ms"] for r in rows}
    for r in rows:
        if r["target"].startswith("hgxserve-kv"):
            extra = r["cpu_ms"] - least.get((r["target"].replace("hgxserve-kv", ""), r["c"]), 0)
            print(
                f"  {r['target']} C={r['c']}: {r['cpu_ms']:.3f} CPU ms/req; tokenizer "
                f"{warm / r['cpu_ms'] * 100:.0f}-{spaced / r['cpu_ms'] * 100:.0f} % (back to "
                f"back - spaced); over least-outstanding {extra:+.3f} ms "
                f"({extra / r['cpu_ms'] * 100:.0f} %: tokenizer + decision)"
            )
    print("hgxserve-kv prompts matched by:", "; ".join(matched))
    print(
        f"decode NIXL transfers: {xfers:.0f} successful, {fails:.0f} failed "
        "(direct requests carry no KV params and transfer nothing)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
