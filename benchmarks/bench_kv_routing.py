"""KV-aware routing, measured in one run on 127.0.0.1 against simulated engines with prefix caches.

Four combined simulated vLLM engines (prefix caching, LRU at a KV capacity that holds about half
of the workload's distinct prefixes, prefill time proportional to uncached tokens, KV events over
ZMQ) behind, in turn:
  hgxserve/<policy>   `hgxserve proxy serve` with routing.policy = least-outstanding,
                      approximate, kv-events (each policy the proxy accepts; one it rejects is
                      reported as not supported by this proxy)
  vllm-router         vllm-router --policy cache_aware (its defaults), the outside anchor
Load: AIPerf multi-turn chat conversations (history resent each turn), each starting with one
of a pool of long prefix prompts (--num-prefix-prompts); the skewed variant gives every
conversation the same prefix (one hot prefix). Engines restart before each target, so every
target starts cold. Token counts are the demo model's byte-level tokenizer's (one token per
UTF-8 byte), the ids the simulated engines cache and that a proxy with the demo tokenizer sees.

Then a P/D variant: 1 prefill + 2 decodes (vLLM NIXL protocol), least-outstanding (today's
length buckets) against kv-events: the share of requests whose decode skipped the remote
prefill (it prefilled locally, from /sim/requests) and TTFT.

    .venv/bin/python benchmarks/bench_kv_routing.py --vllm-router /tmp/vr/venv/bin/vllm-router

Prints per target: TTFT p50/p90 (ms), output tok/s, requests, errors, prefix-cache hit rate
over all engines, max/min requests per engine (each engine's vllm:request_success_total).

Scratch venv for the anchor (kept out of the project's dependencies):
    python3 -m venv /tmp/vr/venv && /tmp/vr/venv/bin/pip install vllm-router==0.1.17
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchlib import free_port, wait_http

from hgxserve.base.routing import POLICY_NAMES
from hgxserve.bench.generator import find_export, parse_export
from testbed import demo

ROOT = Path(__file__).resolve().parents[1]
SIMENGINE = ROOT / "testbed" / "simengine.py"
HGXSERVE = Path(sys.executable).with_name("hgxserve")
AIPERF = Path(os.environ.get("HGXSERVE_AIPERF", str(ROOT / ".venv-aiperf" / "bin" / "aiperf")))


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.clear()


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until GET `url` answers 200; SystemExit when `proc` exits first or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            wait_http(url, 1)
            return
        except SystemExit:
            pass
    raise SystemExit(f"not ready: {url}")


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Engine:
    """One simulated vLLM engine with a prefix cache publishing KV events."""

    def __init__(self, name: str, work: Path, env: dict[str, str], kv_role: str | None) -> None:
        self.name, self.work, self.env, self.kv_role = name, work, env, kv_role
        self.port, self.pub, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, max_num_seqs: int) -> subprocess.Popen[bytes]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # a wildcard: the real publisher binds only those (a host address means connect)
            "endpoint": f"tcp://*:{self.pub}",
            "replay_endpoint": f"tcp://*:{self.replay}",
            "topic": "kv-events",
        }
        cmd = [
            sys.executable, str(SIMENGINE), "--engine", "vllm", "serve", "/models/m",
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port),
            "--max-num-seqs", str(max_num_seqs), "--max-model-len", "65536",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        env = dict(self.env)
        if self.kv_role:
            transfer = {"kv_connector": "NixlConnector", "kv_role": self.kv_role}
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        self.proc = start(cmd, env, self.work / f"{self.name}.log")
        return self.proc

    def endpoint(self, with_events: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"url": self.url}
        if with_events:
            entry["kv_events"] = {
                "publishers": [f"tcp://127.0.0.1:{self.pub}"],
                "replays": [f"tcp://127.0.0.1:{self.replay}"],
                "topic": "kv-events",
            }
        return entry

    def figures(self) -> dict[str, float]:
        text = get(self.url + "/metrics").decode()
        return {
            "requests": metric_sum(text, "vllm:request_success_total"),
            "queries": metric_sum(text, "vllm:prefix_cache_queries_total"),
            "hits": metric_sum(text, "vllm:prefix_cache_hits_total"),
        }

    def sim_requests(self) -> list[dict[str, Any]]:
        return list(json.loads(get(self.url + "/sim/requests"))["requests"])


def aiperf(url: str, args: argparse.Namespace, prefixes: int, tokenizer: Path, out: Path) -> dict:
    cmd = [
        str(AIPERF), "profile", "--model", "m", "--url", url,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer),
        "--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--conversation-num", str(args.conversations),
        "--conversation-turn-mean", str(args.turns), "--conversation-turn-stddev", "0",
        "--num-prefix-prompts", str(prefixes), "--prefix-prompt-length", str(args.prefix_len),
        "--concurrency", str(args.concurrency), "--random-seed", str(args.seed),
        "--artifact-dir", str(out), "--ui-type", "none",
        "--no-gpu-telemetry", "--no-server-metrics",
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    with (out / "aiperf.log").open("wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if rc.returncode != 0:
        raise RuntimeError(f"AIPerf exited {rc.returncode}: see {out / 'aiperf.log'}")
    return parse_export(find_export(out))


def proxy_config(port: int, policy: str, tokenizer: Path, layout: dict[str, Any]) -> dict:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "protocol": "vllm-nixl",
        "served_model_name": "m",
        "health": {"interval_s": 5, "timeout_s": 10},
        **layout,
    }
    if policy != "least-outstanding":  # today's proxy knows no policy key: leave it out
        config["routing"] = {"policy": policy}
        if policy == "kv-events":
            config["routing"]["tokenizer_dir"] = str(tokenizer)
            if "pd_groups" in layout:
                # the contract's 512-token default, in the demo tokenizer's tokens (bytes):
                # about 4 bytes per token of a real tokenizer
                config["routing"]["pd_remote_prefill_min_uncached_tokens"] = 2048
    if "pd_groups" in layout and "combined" not in layout:
        # no combined engines: every request takes the P/D route (the proxy requires 0 here)
        config.setdefault("routing", {})["pd_min_prompt_tokens"] = 0
    return config


def run_target(
    name: str,
    engines: list[Engine],
    front: list[str] | None,
    proxy_json: dict | None,
    args: argparse.Namespace,
    prefixes: int,
    tokenizer: Path,
    work: Path,
) -> dict:
    """Fresh engines, the front (hgxserve proxy or vllm-router), one AIPerf run."""
    procs: list[subprocess.Popen[bytes]] = []
    row: dict[str, Any] = {"target": name}
    try:
        for eng in engines:
            procs.append(eng.start(args.max_num_seqs))
        for eng in engines:
            wait_http(eng.url + "/health")
        port = free_port()
        log = work / f"front-{name.replace('/', '-')}-{prefixes}.log"
        if proxy_json is not None:
            path = work / f"proxy-{name.replace('/', '-')}.json"
            path.write_text(json.dumps(proxy_config(port, **proxy_json)))
            cmd = [str(HGXSERVE), "proxy", "serve", "--config", str(path), "--log-level", "warning"]
        else:
            assert front is not None
            cmd = [*front, "--host", "127.0.0.1", "--port", str(port)]
        px = start(cmd, os.environ.copy(), log)
        procs.append(px)
        try:
            wait_up(f"http://127.0.0.1:{port}/health", px)
        except SystemExit:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            row["skipped"] = "did not start: " + " | ".join(tail)[:300]
            return row
        out = work / f"aiperf-{name.replace('/', '-')}-{prefixes}"
        row.update(aiperf(f"http://127.0.0.1:{port}", args, prefixes, tokenizer, out))
        figs = [eng.figures() for eng in engines]
        row["per_engine"] = [int(f["requests"]) for f in figs]
        queries = sum(f["queries"] for f in figs)
        row["hit_rate"] = sum(f["hits"] for f in figs) / queries if queries else float("nan")
        decodes = [e for e in engines if e.kv_role == "kv_consumer"]
        if decodes:
            seen = [r for e in decodes for r in e.sim_requests()]
            local = sum(1 for r in seen if r["kv"] == "local")
            row["skip_remote"] = local / len(seen) if seen else float("nan")
        return row
    finally:
        stop(procs)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    head = (
        f"{'target':<30}{'TTFT p50':>10}{'TTFT p90':>10}{'out tok/s':>11}{'req':>6}{'err':>5}"
        f"{'hit %':>7}{'max/min req per engine':>24}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['target']:<30}not run: {r['skipped']}")
            continue
        per = r["per_engine"]
        spread = f"{max(per)}/{min(per)} {per}"
        print(
            f"{r['target']:<30}{r['ttft_ms_p50']:>10.0f}{r['ttft_ms_p90']:>10.0f}"
            f"{r['output_token_throughput']:>11.1f}{r['requests']:>6.0f}{r['errors']:>5.0f}"
            f"{r['hit_rate'] * 100:>7.1f}{spread:>24}"
            + (
                f"  skipped remote prefill: {r['skip_remote'] * 100:.0f} %"
                if "skip_remote" in r
                else ""
            )  # fmt: skip
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-router", help="path to the vllm-router executable (PyPI vllm-router)")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8, help="distinct prefix prompts (pool)")
    ap.add_argument("--prefix-len", type=int, default=6000, help="prefix tokens (bytes)")
    ap.add_argument("--isl", type=int, default=600, help="new user tokens (bytes) per turn")
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=4, help="per engine (queueing shows)")
    ap.add_argument("--prefill-s-per-1k", default="0.25", help="the sims' prefill time knob")
    ap.add_argument(
        "--kv-tokens", type=int, default=0, help="per-engine KV tokens (default: half the prefixes)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-skewed", action="store_true")
    ap.add_argument("--no-pd", action="store_true")
    args = ap.parse_args()
    if not AIPERF.exists():
        raise SystemExit(f"no AIPerf at {AIPERF} (set HGXSERVE_AIPERF)")
    work = Path(tempfile.mkdtemp(prefix="bench-kv-routing-"))
    tokenizer = demo.make_tiny_model(work / "model", shards=1, shard_mib=1)
    kv_tokens = args.kv_tokens or args.prefixes * args.prefix_len // 2
    env = {
        **os.environ,
        "HGXSERVE_SIM_START_SECONDS": "0.2",
        "HGXSERVE_SIM_STOP_SECONDS": "0.1",
        "HGXSERVE_SIM_TOKEN_SECONDS": "0.01",
        "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": args.prefill_s_per_1k,
        "HGXSERVE_SIM_KV_TOKENS": str(kv_tokens),
        "HGXSERVE_SIM_GPU_DIR": str(work / "gpus"),
    }
    policies = [p for p in args.policies.split(",") if p]
    combined = [Engine(f"c{i}", work, env, None) for i in range(4)]
    variants = [("mixed", args.prefixes)] + ([] if args.no_skewed else [("skewed", 1)])
    results: list[tuple[str, list[dict[str, Any]]]] = []
    for label, prefixes in variants:
        rows = []
        for policy in policies:
            layout = {"combined": [e.endpoint(policy == "kv-events") for e in combined]}
            spec = {"policy": policy, "tokenizer": tokenizer, "layout": layout}
            print(f"[{label}] hgxserve/{policy} ...", flush=True)
            rows.append(run_target(f"hgxserve/{policy}", combined, None, spec, args, prefixes,
                                   tokenizer, work))  # fmt: skip
        if args.vllm_router:
            front = [args.vllm_router, "--policy", "cache_aware", "--worker-urls",
                     *[e.url for e in combined]]  # fmt: skip
            print(f"[{label}] vllm-router/cache_aware ...", flush=True)
            rows.append(run_target("vllm-router/cache_aware", combined, front, None, args,
                                   prefixes, tokenizer, work))  # fmt: skip
        results.append((label, rows))
    if not args.no_pd:
        pre = Engine("p0", work, env, "kv_producer")
        decs = [Engine(f"d{i}", work, env, "kv_consumer") for i in range(2)]
        rows = []
        for policy in ("least-outstanding", "kv-events"):
            if policy not in policies:
                continue
            events = policy == "kv-events"
            layout = {"pd_groups": [{"name": "pd-0", "prefill": [pre.endpoint(events)],
                                     "decode": [d.endpoint(events) for d in decs]}]}  # fmt: skip
            spec = {"policy": policy, "tokenizer": tokenizer, "layout": layout}
            print(f"[pd] hgxserve/{policy} ...", flush=True)
            rows.append(run_target(f"hgxserve/{policy}", [pre, *decs], None, spec, args,
                                   args.prefixes, tokenizer, work))  # fmt: skip
        results.append(("pd", rows))
    print(
        f"\nKV-aware routing on 127.0.0.1 ({os.cpu_count()} CPUs), simulated vLLM engines: "
        f"{args.conversations} conversations x {args.turns} turns, prefix {args.prefix_len} + "
        f"{args.isl} new tokens per turn, {args.osl} out, concurrency {args.concurrency}, "
        f"max_num_seqs {args.max_num_seqs}, prefill {args.prefill_s_per_1k} s per 1k reported "
        f"tokens (~4 bytes each) uncached, KV {kv_tokens} tokens per engine; work dir {work}"
    )
    titles = {
        "mixed": f"4 combined engines, {args.prefixes} prefixes (pool), multi-turn",
        "skewed": "4 combined engines, one hot prefix (every conversation), multi-turn",
        "pd": f"P/D: 1 prefill + 2 decodes (vllm-nixl), {args.prefixes} prefixes, multi-turn",
    }
    for label, rows in results:
        print_rows(titles[label], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
