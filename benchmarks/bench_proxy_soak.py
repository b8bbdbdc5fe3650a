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

--scenario stalled: clients that stop reading, and one that hoards connections:

  stalled   --streams clients (from 127.0.0.2) each open a long streamed completion with a
            4 KiB receive buffer and never read it: the proxy's writes to them block until
            `limits.client_write_timeout_s` (--write-timeout-s for the run) cuts them
  holder    one client (from 127.0.0.3) that opens connections until the proxy refuses it
            (max_connections x max_client_share) and reopens each one the proxy closes
  normal    one client (from 127.0.0.1), --requests short completions one after another,
            measured before (unloaded) and while the others press (loaded)

Prints unloaded and loaded p50/p99 side by side, their ratio, the normal requests that failed,
the proxy's RSS (before / at the loaded peak / after the stalled clients were cut and the
holder left) and hgxserve_proxy_client_stalled_total; the attack runs --rounds times (2: the
second shows whether memory the first left is reused). The proxy runs with a /metrics key
(auth.metrics_key_file), which the benchmark sends. Exits 1 when a round's loaded p99 is over
--max-ratio x the unloaded p99, a normal request failed, fewer than --streams clients were cut
as stalled, a stream was cut before the loaded phase ended, or the RSS passes its bounds:
growth while loaded over --rss-growth-mib (STREAM_MIB per stream plus OTHERS_MIB), or, after a
round or at a later round's peak, more than --rss-reuse-mib over the first round's peak. All
traffic is on 127.0.0.0/8 (the three client addresses are loopback addresses, so the proxy's
per-address share tells them apart).

    .venv/bin/python benchmarks/bench_proxy_soak.py --scenario stalled
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
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


async def timed_completion(session: aiohttp.ClientSession, url: str, body: dict) -> float | None:
    """One completion: its latency in seconds when answered 200, else None."""
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            await resp.read()
            if resp.status == 200:
                return time.perf_counter() - t0
    except (TimeoutError, aiohttp.ClientError):
        pass
    return None


async def normal_client(url: str, seconds: float) -> tuple[list[float], int]:
    """One request at a time for `seconds`: latencies of the good ones, count of the others."""
    body = {"model": "m", "prompt": "normal client", "max_tokens": 1, "temperature": 0}
    latencies: list[float] = []
    errors = 0
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            took = await timed_completion(session, url, body)
            if took is not None:
                latencies.append(took)
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


# ---------------------------------------------------------------- --scenario stalled

NORMAL_ADDR, STALLED_ADDR, HOLDER_ADDR = "127.0.0.1", "127.0.0.2", "127.0.0.3"
# What one stalled stream may hold in the proxy: the engine's answer it queues before it stops
# reading from the engine (hgxserve.proxy.upstream.PAUSE_BYTES, 256 KiB), the client transport's
# buffer (64 KiB high water, plus up to 64 KiB aiohttp writes between drains) and the objects
# of the queued chunks; measured 0.79 MiB per stream (100 streams, 2-core dev machine; 1.36 MiB
# when PAUSE_BYTES was 1 MiB).
STREAM_MIB = 1.0
# everything else: the holder's 2048 idle connections measured 10 MiB
OTHERS_MIB = 32.0
STALLED_METRIC = "hgxserve_proxy_client_stalled_total"


def metric_value(text: str, name: str) -> float:
    """The value of an unlabelled sample `name` in Prometheus text; NaN without one."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def scrape(session: aiohttp.ClientSession, url: str, key: str | None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url + "/metrics", headers=headers) as resp:
        return await resp.text()


async def normal_requests(
    url: str, count: int, tokens: int, starts: list[float] | None = None
) -> tuple[list[float], int]:
    """`count` short completions one after another from NORMAL_ADDR: latencies of the good
    ones, count of the others; with `starts`, each good one's start (time.monotonic()) too."""
    body = {"model": "m", "prompt": "normal client", "max_tokens": tokens, "ignore_eos": True}
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(local_addr=(NORMAL_ADDR, 0))
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(count):
            took = await timed_completion(session, url, body)
            if took is not None:
                latencies.append(took)
                if starts is not None:
                    starts.append(time.monotonic() - took)
            else:
                errors += 1
    return latencies, errors


# what a client across Ethernet (MTU 1500) announces; loopback's own MSS (65483) would let the
# proxy's kernel buffer ~4 MB per stalled client before the proxy sees a blocked write, which
# no client across a network gets
ETHERNET_MSS = 1448


def _client_socket(source: str, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, ETHERNET_MSS)
    sock.bind((source, 0))
    sock.setblocking(False)
    return sock


async def stalled_stream(port: int, tokens: int, stop: asyncio.Event, tally: dict) -> None:
    """A streamed completion whose client never reads: its socket stays open until `stop`."""
    loop = asyncio.get_running_loop()
    sock = _client_socket(STALLED_ADDR, rcvbuf=4096)
    body = json.dumps(
        {"model": "m", "prompt": "stall", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    )
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, (head + body).encode())
        tally["opened"] = tally.get("opened", 0) + 1
        await stop.wait()
    except OSError:
        tally["failed"] = tally.get("failed", 0) + 1
    finally:
        sock.close()


class Holder:
    """One client address that holds as many connections as the proxy lets it: it opens them
    one after another until the proxy answers 503 (its share is full), and reopens each one
    the proxy closes (an idle connection is closed after `header_timeout_s`)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.held = 0
        self.peak = 0
        self.refused = 0
        self.reopened = 0
        self.reopen_times: list[float] = []  # time.monotonic() of each reopen
        self.full = asyncio.Event()

    async def one(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            sock = _client_socket(HOLDER_ADDR)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", self.port))
            except OSError:
                sock.close()
                self.refused += 1
                self.full.set()
                return
            self.held += 1
            self.peak = max(self.peak, self.held)
            try:
                recv = asyncio.ensure_future(loop.sock_recv(sock, 4096))
                halt = asyncio.ensure_future(stop.wait())
                await asyncio.wait({recv, halt}, return_when=asyncio.FIRST_COMPLETED)
                halt.cancel()
                data = recv.result() if recv.done() and not recv.exception() else None
                recv.cancel()
            finally:
                self.held -= 1
                sock.close()
            if data and data.startswith(b"HTTP/1.1 503"):
                self.refused += 1
                self.full.set()
                return
            if not stop.is_set():
                self.reopened += 1
                self.reopen_times.append(time.monotonic())

    async def run(self, stop: asyncio.Event) -> None:
        tasks = []
        while not self.full.is_set() and not stop.is_set():
            tasks.append(asyncio.ensure_future(self.one(stop)))
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def until_quiet(pids: list[int], limit_s: float, busy_share: float = 0.03) -> float:
    """Seconds until the processes `pids` together use under `busy_share` of a CPU for three
    seconds in a row (the stalled streams filled every buffer and every write blocks: nothing
    moves), at most `limit_s`."""
    started = time.monotonic()
    quiet = 0
    last = sum(cpu_s(p) for p in pids)
    while time.monotonic() - started < limit_s and quiet < 3:
        await asyncio.sleep(1.0)
        now = sum(cpu_s(p) for p in pids)
        quiet = quiet + 1 if now - last < busy_share else 0
        last = now
    return time.monotonic() - started


async def attack_round(
    url: str, port: int, args: argparse.Namespace, pids: tuple[int, int], session: Any
) -> dict[str, Any]:
    """One attack: the stalled streams and the holder, the normal client measured once the
    streams stalled, until every stream was cut and the holder left."""
    pid, engine_pid = pids
    stop = asyncio.Event()
    tally: dict[str, int] = {}
    holder = Holder(port)
    started = time.monotonic()
    streams = [
        asyncio.ensure_future(stalled_stream(port, args.stream_tokens, stop, tally))
        for _ in range(args.streams)
    ]
    holding = asyncio.ensure_future(holder.run(stop))
    await asyncio.wait_for(holder.full.wait(), 120)
    quiet_after = await until_quiet([pid, engine_pid], args.write_timeout_s / 2)
    await asyncio.sleep(args.ramp_s)
    peak = [rss_mib(pid)[0]]

    async def sample() -> None:
        while True:
            peak.append(rss_mib(pid)[0])
            await asyncio.sleep(0.25)

    sampler = asyncio.ensure_future(sample())
    loaded_started = time.monotonic() - started
    starts: list[float] = []
    loaded, loaded_err = await normal_requests(url, args.requests, args.tokens, starts)
    loaded_s = time.monotonic() - started - loaded_started
    held_during = holder.held
    text = await scrape(session, url, args.metrics_key)
    open_during = metric_value(text, "hgxserve_proxy_open_connections")
    # the stalled clients are cut client_write_timeout_s after their writes blocked
    deadline = time.monotonic() + args.write_timeout_s + 60
    stalled = stalled_while_loaded = metric_value(text, STALLED_METRIC)
    while stalled < args.stalled_target and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        stalled = metric_value(await scrape(session, url, args.metrics_key), STALLED_METRIC)
    cut_after_s = time.monotonic() - started
    sampler.cancel()
    stop.set()
    await asyncio.gather(*streams, holding)
    await asyncio.sleep(3)
    text = await scrape(session, url, args.metrics_key)
    # the slowest loaded requests, and how many of the holder's reopens fell within a second
    # of each (its idle connections all reach header_timeout_s together and come back at once)
    slowest = sorted(zip(loaded, starts, strict=True), reverse=True)[: max(1, len(loaded) // 100)]
    near = [
        (lat, t - started, sum(1 for r in holder.reopen_times if t - 1 <= r <= t + lat + 1))
        for lat, t in slowest
    ]
    return {
        "loaded": loaded,
        "loaded_err": loaded_err,
        "slowest": near,
        "reopen_bursts": _bursts([t - started for t in holder.reopen_times]),
        "loaded_window_s": (loaded_started, loaded_started + loaded_s),
        "quiet_after_s": quiet_after,
        "streams_opened": tally.get("opened", 0),
        "streams_failed": tally.get("failed", 0),
        "holder": {
            "peak": holder.peak,
            "held_while_loaded": held_during,
            "refused": holder.refused,
            "reopened": holder.reopened,
        },
        "open_connections_loaded": open_during,
        "stalled": stalled,
        "stalled_while_loaded": stalled_while_loaded,
        "stalled_after_s": cut_after_s,
        "open_connections_after": metric_value(text, "hgxserve_proxy_open_connections"),
        "in_flight_after": metric_value(text, "hgxserve_proxy_in_flight_requests"),
        "rss_peak": max(peak),
        "rss_after": rss_mib(pid)[0],
    }


def _bursts(times: list[float], gap: float = 2.0) -> list[tuple[float, float, int]]:
    """(first, last, count) of each run of `times` with no gap over `gap` seconds."""
    out: list[tuple[float, float, int]] = []
    for t in sorted(times):
        if out and t - out[-1][1] <= gap:
            first, _, n = out[-1]
            out[-1] = (first, t, n + 1)
        else:
            out.append((t, t, 1))
    return out


async def stalled_soak(
    url: str, port: int, args: argparse.Namespace, pids: tuple[int, int]
) -> dict[str, Any]:
    """Unloaded, then --rounds attacks (`attack_round`); the first round's figures, with every
    round's RSS after it (a second round shows whether memory kept is reused or leaked)."""
    pid = pids[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await normal_requests(url, max(5, args.requests // 20), args.tokens)  # warm-up
        unloaded, unloaded_err = await normal_requests(url, args.requests, args.tokens)
        rss_before = rss_mib(pid)[0]
        rounds = []
        for n in range(args.rounds):
            args.stalled_target = args.streams * (n + 1)  # the counter only grows
            rounds.append(await attack_round(url, port, args, pids, session))
    first = rounds[0]
    return {
        **first,
        "unloaded": unloaded,
        "unloaded_err": unloaded_err,
        "stalled": first["stalled"],
        "rss": (rss_before, first["rss_peak"], first["rss_after"], rss_mib(pid)[1]),
        "rounds": [
            {
                "p99": pct(r["loaded"], 0.99),
                "failed": r["loaded_err"],
                "peak": r["rss_peak"],
                "after": r["rss_after"],
                "stalled": r["stalled"],
            }
            for r in rounds
        ],  # fmt: skip
    }


def stalled_misses(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What the run missed of its targets (empty: all met)."""
    misses = []
    p99_unloaded = pct(r["unloaded"], 0.99)
    for n, x in enumerate(r["rounds"], start=1):
        ratio = x["p99"] / p99_unloaded if p99_unloaded > 0 else float("inf")
        if not ratio <= args.max_ratio:
            misses.append(
                f"round {n}: loaded p99 is {ratio:.2f}x the unloaded p99 "
                f"(target <= {args.max_ratio:g}x)"
            )
        if x["failed"]:
            misses.append(f"round {n}: {x['failed']} normal request(s) failed")
    if r["unloaded_err"]:
        misses.append(f"{r['unloaded_err']} unloaded normal request(s) failed")
    if not r["stalled"] >= args.streams:
        misses.append(f"{STALLED_METRIC} is {r['stalled']:g}, not {args.streams}")
    if r["stalled_while_loaded"] > 0:
        misses.append(
            f"{r['stalled_while_loaded']:g} stream(s) were cut before the loaded phase ended: "
            "raise --write-timeout-s"
        )
    # a stream is cut write_timeout_s after its writes blocked: the last one blocked by then
    last_stall = r["stalled_after_s"] - args.write_timeout_s
    if last_stall > r["loaded_window_s"][0] + 1.0:  # 0.5 s polls of the counter
        misses.append(
            f"the last stream stalled only by {last_stall:.1f} s, after the loaded phase began "
            f"at {r['loaded_window_s'][0]:.1f} s: raise --ramp-s"
        )
    before, during, after, _ = r["rss"]
    if during - before > args.rss_growth_mib:
        misses.append(
            f"RSS grew {during - before:.0f} MiB while loaded (bound {args.rss_growth_mib:g})"
        )
    if after - during > args.rss_reuse_mib:
        misses.append(f"RSS after ({after:.0f} MiB) passed the loaded peak ({during:.0f} MiB)")
    for n, x in enumerate(r["rounds"][1:], start=2):
        if x["peak"] - during > args.rss_reuse_mib:
            misses.append(
                f"round {n}: RSS peaked {x['peak'] - during:.0f} MiB above round 1's "
                f"(bound {args.rss_reuse_mib:g}): memory not reused"
            )
    return misses


def print_stalled(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nproxy soak (stalled clients) on 127.0.0.1, {os.cpu_count()} CPUs: {args.streams} "
        f"streams that stop reading + one connection holder; client_write_timeout_s "
        f"{args.write_timeout_s:g} s; normal client: {args.requests} completions of "
        f"{args.tokens} tokens ({args.token_s:g} s per simulated token)"
    )
    head = f"{'phase':<10}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'failed':>8}"
    print(head)
    print("-" * len(head))
    for phase in ("unloaded", "loaded"):
        lat = r[phase]
        print(
            f"{phase:<10}{len(lat):>6}{pct(lat, 0.5) * 1e3:>9.1f}{pct(lat, 0.99) * 1e3:>9.1f}"
            f"{max(lat, default=float('nan')) * 1e3:>9.1f}{r[phase + '_err']:>8}"
        )
    p99u, p99l = pct(r["unloaded"], 0.99), pct(r["loaded"], 0.99)
    p50u, p50l = pct(r["unloaded"], 0.5), pct(r["loaded"], 0.5)
    print(
        f"ratio loaded/unloaded: p50 {p50l / p50u:.2f}x, p99 {p99l / p99u:.2f}x "
        f"(target p99 <= {args.max_ratio:g}x)"
    )
    start, end = r["loaded_window_s"]
    h = r["holder"]
    print(
        f"loaded window {start:.1f}-{end:.1f} s after the attack began (proxy and engine "
        f"quiet {r['quiet_after_s']:.1f} s after the holder was full): {r['streams_opened']} "
        f"streams open ({r['streams_failed']} failed to open), holder held "
        f"{h['held_while_loaded']} "
        f"(peak {h['peak']}, refused {h['refused']}, reopened {h['reopened']}), proxy open "
        f"connections {r['open_connections_loaded']:g}"
    )
    bursts = ", ".join(f"{a:.0f}-{b:.0f} s ({n})" for a, b, n in r["reopen_bursts"])
    print(f"holder reopened connections (closed at header_timeout_s) at {bursts or 'no time'}")
    print(
        "slowest loaded requests (ms, started at s, holder reopens within 1 s): "
        + "; ".join(f"{lat * 1e3:.0f}, {t:.1f}, {n}" for lat, t, n in r["slowest"])
    )
    before, during, after, hwm = r["rss"]
    print(
        f"proxy RSS MiB: before {before:.0f} / loaded peak {during:.0f} / after {after:.0f} "
        f"(VmHWM {hwm:.0f}; bounds: +{args.rss_growth_mib:g} loaded; after and later rounds "
        f"<= loaded peak +{args.rss_reuse_mib:g})"
    )
    if len(r["rounds"]) > 1:
        print(
            "rounds (loaded p99 ms, failed, RSS MiB peak / after, stalled total): "
            + "; ".join(
                f"{x['p99'] * 1e3:.0f}, {x['failed']}, {x['peak']:.0f} / {x['after']:.0f}, "
                f"{x['stalled']:g}"
                for x in r["rounds"]
            )
        )
    print(
        f"{STALLED_METRIC} {r['stalled']:g} at {r['stalled_after_s']:.1f} s (every stream "
        f"stalled by {r['stalled_after_s'] - args.write_timeout_s:.1f} s, "
        f"{r['stalled_while_loaded']:g} cut before the loaded phase ended); after: open "
        f"connections {r['open_connections_after']:g}, in flight {r['in_flight_after']:g}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scenario", choices=("crowd", "stalled"), default="crowd")
    ap.add_argument("--baseline-tree", help="crowd: also soak hgxserve from this source tree")
    ap.add_argument("--crowd", type=int, default=1000, help="requests kept in flight")
    ap.add_argument("--crowd-tokens", type=int, default=40, help="tokens per crowd request")
    ap.add_argument(
        "--token-s", type=float, help="simulated seconds per token (crowd 0.25, stalled 0.005)"
    )
    ap.add_argument("--slow-heads", type=int, default=100)
    ap.add_argument("--slow-bodies", type=int, default=200)
    ap.add_argument("--slow-body-mib", type=float, default=4.0)
    ap.add_argument("--quiet-s", type=float, default=5.0)
    ap.add_argument(
        "--ramp-s",
        type=float,
        help="settling time (crowd 10; stalled 2, after the proxy and engine went quiet)",
    )
    ap.add_argument("--soak-s", type=float, default=40.0)
    stalled = ap.add_argument_group("--scenario stalled")
    stalled.add_argument("--streams", type=int, default=200, help="clients that stop reading")
    stalled.add_argument(
        "--stream-tokens",
        type=int,
        default=5000,
        help="tokens each stalled stream asks for (about 800 fill its buffers)",
    )
    stalled.add_argument("--requests", type=int, default=300, help="normal requests per phase")
    stalled.add_argument("--tokens", type=int, default=8, help="tokens per normal request")
    stalled.add_argument(
        "--write-timeout-s",
        type=float,
        default=45.0,
        help="the proxy's limits.client_write_timeout_s for this run (production default 60)",
    )
    stalled.add_argument(
        "--max-connections", type=int, help="limits.max_connections (default: the proxy's)"
    )
    stalled.add_argument("--max-ratio", type=float, default=2.0, help="loaded p99 / unloaded p99")
    stalled.add_argument(
        "--rss-growth-mib",
        type=float,
        help="bound on the proxy's RSS growth while loaded (default: STREAM_MIB per stream, "
        "plus OTHERS_MIB)",
    )
    stalled.add_argument(
        "--rss-reuse-mib",
        type=float,
        default=32.0,
        help="RSS after a round, or a later round's peak, may pass the first round's loaded peak "
        "by this much (more: memory not reused, a leak)",
    )
    stalled.add_argument(
        "--rounds", type=int, default=2, help="attacks one after another (RSS after each)"
    )
    args = ap.parse_args(argv)
    if args.token_s is None:
        args.token_s = 0.005 if args.scenario == "stalled" else 0.25
    if args.rss_growth_mib is None:
        args.rss_growth_mib = args.streams * STREAM_MIB + OTHERS_MIB
    if args.ramp_s is None:
        args.ramp_s = 2.0 if args.scenario == "stalled" else 10.0
    return args


def start_engine(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """One simulated vLLM engine on 127.0.0.1 with room for every request at once."""
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
            "10000000",
        ],
        stdout=(work / "engine.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    return engine, engine_port


def start_proxy(
    cmd: list[str], work: Path, name: str, config: dict[str, Any], env: dict[str, str]
) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port}, **config}
    (work / f"{name}.json").write_text(json.dumps(config))
    proc = subprocess.Popen(
        [*cmd, "proxy", "serve", "--config", str(work / f"{name}.json")],
        stdout=(work / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process we started, by its PID; SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sim_env(work: Path, token_s: float) -> dict[str, str]:
    return {
        **os.environ,
        "HGXSERVE_SIM_START_SECONDS": "0.2",
        "HGXSERVE_SIM_TOKEN_SECONDS": str(token_s),
        "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": "0",
        "HGXSERVE_SIM_GPU_DIR": str(work / "gpus"),
    }


def run_stalled(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The stalled scenario against `hgxserve proxy serve` with its /metrics key on; the
    result of `stalled_soak`."""
    env = sim_env(work, args.token_s)
    key_file = work / "metrics-key"
    key_file.touch(mode=0o600)
    args.metrics_key = secrets.token_hex(16)
    key_file.write_text(args.metrics_key + "\n")
    engine, engine_port = start_engine(work, env)
    limits: dict[str, Any] = {"client_write_timeout_s": args.write_timeout_s}
    if args.max_connections:
        limits["max_connections"] = args.max_connections
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        config = {
            "protocol": "vllm-nixl",
            "served_model_name": "m",
            "combined": [f"http://127.0.0.1:{engine_port}"],
            "health": {"interval_s": 2, "timeout_s": 10},
            "limits": limits,
            "auth": {"metrics_key_file": str(key_file)},
        }
        proc, port = start_proxy([str(HGXSERVE)], work, "hgxserve", config, env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health")
            return asyncio.run(stalled_soak(url, port, args, (proc.pid, engine.pid)))
        finally:
            stop(proc)
    finally:
        stop(engine)


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    if args.scenario == "stalled":
        result = run_stalled(args, work)
        print_stalled(result, args)
        print(f"logs: {work}")
        misses = stalled_misses(result, args)
        for miss in misses:
            print(f"MISSED: {miss}")
        return 1 if misses else 0
    env = sim_env(work, args.token_s)
    engine, engine_port = start_engine(work, env)
    targets: dict[str, list[str]] = {"hgxserve": [str(HGXSERVE)]}
    if args.baseline_tree:
        targets = {"baseline": baseline_command(args.baseline_tree), **targets}
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        for name, cmd in targets.items():
            config = {
                "protocol": "vllm-nixl",
                "served_model_name": "m",
                "combined": [f"http://127.0.0.1:{engine_port}"],
                # one simulated engine carries the whole crowd on a shared machine: a longer
                # health timeout keeps its slow /health from ejecting it mid-soak (both proxies)
                "health": {"interval_s": 2, "timeout_s": 10},
            }
            proc, port = start_proxy(cmd, work, name, config, env)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_http(url + "/health")
                print(f"soaking {name} ...", flush=True)
                results[name] = asyncio.run(soak(url, port, args, proc.pid))
            finally:
                stop(proc)
    finally:
        stop(engine)
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
