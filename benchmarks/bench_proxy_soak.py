"""Proxy soak: a normal client's latency while slow clients and a crowd of requests press on it.

One simulated combined engine on 127.0.0.1 (streams a token every --token-s seconds, room for
every request at once) behind `hgxserve proxy serve`, and, with --baseline-tree, behind an
earlier hgxserve revision too, each soaked in turn with the same load in the same run:

  crowd     --crowd requests always in flight (each --crowd-tokens tokens long, a new one as
            soon as one ends)
  slow      --slow-heads clients that trickle a request head (one header line every 2 s), and
            --slow-bodies clients that announce an 8 MiB body, send --slow-body-mib MiB of it at
            once, then one byte every 2 s
  normal    one client, one request at a time (1 token), measured before and during the soak

Prints per proxy: the normal client's p50/p99/max and errors, quiet and under soak; what the
crowd and the slow clients got (answers by status, connections cut); the proxy's RSS before,
at its peak (VmHWM) and after the attackers left.

    .venv/bin/python benchmarks/bench_proxy_soak.py
    mkdir /tmp/base && git archive <rev> hgxserve files schemas | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_proxy_soak.py --baseline-tree /tmp/base
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
HGXSERVE = Path(sys.executable).with_name("hgxserve")
BODY_ANNOUNCED = 8 * 1024 * 1024


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def normal_client(url: str, seconds: float) -> tuple[list[float], int]:
    """One request at a time for `seconds`: latencies of the good ones, count of the others."""
    body = {"model": "m", "prompt": "normal client", "max_tokens": 1, "temperature": 0}
    latencies: list[float] = []
    errors = 0
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
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
            await asyncio.sleep(0.02)
    return latencies, errors


async def crowd(url: str, size: int, tokens: int, stop: asyncio.Event, tally: dict) -> None:
    body = {"model": "m", "prompt": "crowd", "max_tokens": tokens, "ignore_eos": True}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while not stop.is_set():
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        key = str(resp.status)
                except (TimeoutError, aiohttp.ClientError):
                    key = "error"
                    await asyncio.sleep(0.5)
                tally[key] = tally.get(key, 0) + 1
                if key != "200":
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(worker() for _ in range(size)))


async def slow_client(
    port: int, first: bytes, trickle: bytes, stop: asyncio.Event, tally: dict
) -> None:
    """Send `first` at once, then `trickle` every 2 s until answered, cut off or stopped;
    count the outcome in `tally`."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        tally["connect failed"] = tally.get("connect failed", 0) + 1
        return
    outcome = "held to the end"
    try:
        writer.write(first)
        await writer.drain()
        while not stop.is_set():
            try:
                data = await asyncio.wait_for(reader.read(4096), 2.0)
            except TimeoutError:
                writer.write(trickle)
                await writer.drain()
                continue
            outcome = "answered " + data[9:12].decode() if data else "cut off"
            break
    except (ConnectionError, OSError):
        outcome = "cut off"
    tally[outcome] = tally.get(outcome, 0) + 1
    writer.close()


SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def slow_body_start(mib: float) -> bytes:
    """A request head announcing 8 MiB and the first `mib` MiB of its body."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {BODY_ANNOUNCED}\r\n\r\n"
    ).encode()
    return head + b'{"model":"m","prompt":"' + b"y" * int(mib * 1024 * 1024)


async def soak(url: str, port: int, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    quiet, quiet_err = await normal_client(url, args.quiet_s)
    rss_before = rss_mib(pid)[0]
    stop = asyncio.Event()
    crowd_tally: dict[str, int] = {}
    slow_tally: dict[str, int] = {}
    body_start = slow_body_start(args.slow_body_mib)
    tasks = [asyncio.ensure_future(crowd(url, args.crowd, args.crowd_tokens, stop, crowd_tally))]
    tasks += [
        asyncio.ensure_future(slow_client(port, SLOW_HEAD, b"X-Slow: 1\r\n", stop, slow_tally))
        for _ in range(args.slow_heads)
    ]
    tasks += [
        asyncio.ensure_future(slow_client(port, body_start, b"y", stop, slow_tally))
        for _ in range(args.slow_bodies)
    ]
    await asyncio.sleep(args.ramp_s)  # the crowd and the slow clients settle in
    busy, busy_err = await normal_client(url, args.soak_s)
    rss_peak = rss_mib(pid)[1]
    stop.set()
    await asyncio.wait(tasks, timeout=60)
    await asyncio.sleep(3)
    rss_after = rss_mib(pid)[0]
    return {
        "quiet": quiet,
        "quiet_err": quiet_err,
        "busy": busy,
        "busy_err": busy_err,
        "crowd": crowd_tally,
        "slow": slow_tally,
        "rss": (rss_before, rss_peak, rss_after),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline-tree", help="also soak hgxserve from this source tree")
    ap.add_argument("--crowd", type=int, default=1000, help="requests kept in flight")
    ap.add_argument("--crowd-tokens", type=int, default=40, help="tokens per crowd request")
    ap.add_argument("--token-s", type=float, default=0.25, help="simulated seconds per token")
    ap.add_argument("--slow-heads", type=int, default=100)
    ap.add_argument("--slow-bodies", type=int, default=200)
    ap.add_argument("--slow-body-mib", type=float, default=4.0)
    ap.add_argument("--quiet-s", type=float, default=5.0)
    ap.add_argument("--ramp-s", type=float, default=10.0)
    ap.add_argument("--soak-s", type=float, default=40.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    env = {
        **os.environ,
        "HGXSERVE_SIM_START_SECONDS": "0.2",
        "HGXSERVE_SIM_TOKEN_SECONDS": str(args.token_s),
        "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": "0",
        "HGXSERVE_SIM_GPU_DIR": str(work / "gpus"),
    }
    engine_port = free_port()
    engine = subprocess.Popen(
        [
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
            str(engine_port),
            "--max-num-seqs",
            "4096",
            "--max-model-len",
            "1000000",
        ],
        stdout=(work / "engine.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    targets: dict[str, list[str]] = {"hgxserve": [str(HGXSERVE)]}
    if args.baseline_tree:
        targets = {"baseline": baseline_command(args.baseline_tree), **targets}
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        for name, cmd in targets.items():
            port = free_port()
            config = {
                "listen": {"host": "127.0.0.1", "port": port},
                "protocol": "vllm-nixl",
                "served_model_name": "m",
                "combined": [f"http://127.0.0.1:{engine_port}"],
                # one simulated engine carries the whole crowd on a shared machine: a longer
                # health timeout keeps its slow /health from ejecting it mid-soak (both proxies)
                "health": {"interval_s": 2, "timeout_s": 10},
            }
            (work / f"{name}.json").write_text(json.dumps(config))
            proc = subprocess.Popen(
                [*cmd, "proxy", "serve", "--config", str(work / f"{name}.json")],
                stdout=(work / f"{name}.log").open("wb"),
                stderr=subprocess.STDOUT,
                env=env,
            )
            try:
                url = f"http://127.0.0.1:{port}"
                wait_http(url + "/health")
                print(f"soaking {name} ...", flush=True)
                results[name] = asyncio.run(soak(url, port, args, proc.pid))
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(15)
        except subprocess.TimeoutExpired:
            engine.kill()
    print(
        f"\nproxy soak on 127.0.0.1, {os.cpu_count()} CPUs: {args.crowd} requests in flight "
        f"({args.crowd_tokens} tokens x {args.token_s} s), {args.slow_heads} slow heads + "
        f"{args.slow_bodies} slow bodies ({args.slow_body_mib:g} of 8 MiB sent), normal client "
        f"measured {args.quiet_s:g} s quiet and {args.soak_s:g} s under soak"
    )
    head = (
        f"{'proxy':<10}{'phase':<7}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'err':>5}"
        f"{'RSS MiB before/peak/after':>28}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        before, peak, after = r["rss"]
        for phase in ("quiet", "busy"):
            lat = r[phase]
            rss = f"{before:.0f} / {peak:.0f} / {after:.0f}" if phase == "busy" else ""
            print(
                f"{name:<10}{phase:<7}{len(lat):>6}{pct(lat, 0.5) * 1e3:>9.1f}"
                f"{pct(lat, 0.99) * 1e3:>9.1f}{max(lat, default=float('nan')) * 1e3:>9.1f}"
                f"{r[phase + '_err']:>5}{rss:>28}"
            )
    for name, r in results.items():
        print(f"{name}: crowd answers {dict(sorted(r['crowd'].items()))}")
        print(f"{name}: slow clients {dict(sorted(r['slow'].items()))}")
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
