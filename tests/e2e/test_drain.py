"""Drain, never cut, end to end: releases on the real test hosts (real pyinfra CLI over SSH,
real systemd, the real proxy in front of the simulated engine) while clients stream through
the proxy the whole time.

Every stream a client started must end with all its tokens, or be turned away with 503 and
Retry-After before any byte; no client may see a refused or reset connection. The time the
proxy turned clients away is the release's outage (docs/releases.md "Drain, never cut").
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_lab import api_request, demo_lab

from testbed import hosts as testbed_hosts
from testbed.simaccept import accept_simulation_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
PROXY_URL = "http://10.77.0.11:8000"
TOKENS = 160  # per stream: 8 s at 50 ms per simulated token (the drain bound is 20.24 s)
CLIENTS = 4
PROXY = "hgxserve-proxy.service"
ENGINE = "hgxserve-combined-0.service"


def variant(tmp: Path, name: str, token_s: str, proxy_extra: str = "") -> Path:
    """The baseline with the simulated engine's time per token (an engine change when it
    differs) and optional extra proxy settings (a proxy.json change)."""
    text = BASELINE.read_text()
    old = "  runtime: {venv: /opt/vllm-sim}\n"
    assert old in text
    text = text.replace(old, old + f'  env: {{HGXSERVE_SIM_TOKEN_SECONDS: "{token_s}"}}\n')
    if proxy_extra:
        old = "  combined: [combined-0]\n"
        assert old in text
        text = text.replace(old, old + proxy_extra)
    path = tmp / f"{name}.yml"
    path.write_text(accept_simulation_env(text))
    return path


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with demo_lab(testbed, tmp_path_factory.mktemp("demo")) as bed:
        yield bed


def deploy(lab: testbed_hosts.Testbed, topology: Path, stages: str = "engines") -> str:
    proc = lab.pyinfra(
        "deploys/site.py",
        "--data", f"topology={topology}",
        "--data", f"stages={stages}",
        "--data", "health_timeout=75",
        "--data", "confirm_within=120",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def main_pids(lab: testbed_hosts.Testbed) -> dict[str, str]:
    out = lab.ssh(
        "hgx-a", f"systemctl show -p MainPID --value {PROXY} {ENGINE}", check=True
    ).stdout.split()
    return {PROXY: out[0], ENGINE: out[1]}


@dataclass
class Outcome:
    started: float
    ended: float
    status: int = 0
    chunks: int = 0
    finish: str | None = None
    retry_after: str | None = None
    error: str | None = None


def one_stream(
    url: str = PROXY_URL, prompt: str = "tell a long story", tokens: int = TOKENS
) -> Outcome:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    req = api_request(url + "/v1/completions", body)
    out = Outcome(time.time(), 0.0)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            out.status = resp.status
            for line in resp:
                if not line.startswith(b"data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                out.chunks += bool(choice.get("text"))
                out.finish = choice.get("finish_reason") or out.finish
    except urllib.error.HTTPError as exc:
        out.status, out.retry_after = exc.code, exc.headers.get("Retry-After")
        exc.read()
    except (OSError, ValueError) as exc:  # refused, reset, cut short: what must never happen
        out.error = repr(exc)
    out.ended = time.time()
    return out


class Clients:
    """CLIENTS threads streaming through the proxy back to back; after a 503 a client retries
    in 0.2 s (not after Retry-After), so the outage is measured to a fraction of a second."""

    def __init__(self, url: str = PROXY_URL, prompt: str = "tell a long story",
                 tokens: int = TOKENS) -> None:  # fmt: skip
        self.url, self.prompt, self.tokens = url, prompt, tokens
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(CLIENTS)]

    def run(self) -> None:
        while not self.stop.is_set():
            out = one_stream(self.url, self.prompt, self.tokens)
            self.outcomes.append(out)
            if out.status != 200:
                time.sleep(0.2)

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)

    def check(self) -> tuple[list[Outcome], list[Outcome]]:
        """(answered, turned away); asserts every outcome is one of the two."""
        answered = [o for o in self.outcomes if o.status == 200]
        refused = [o for o in self.outcomes if o.status != 200]
        assert not [o for o in self.outcomes if o.error], [o.error for o in self.outcomes]
        for o in answered:
            assert (o.chunks, o.finish) == (self.tokens, "length"), o
        for o in refused:
            assert (o.status, o.retry_after) == (503, "5"), o
        return answered, refused


def test_first_release_of_the_slow_engine(lab: testbed_hosts.Testbed, tmp_path: Path) -> None:
    out = deploy(lab, variant(tmp_path, "slow-a", "0.05"), "runtime,weights,engines")
    assert "GATE-OK" in out
    assert one_stream().chunks == TOKENS


def test_an_engine_release_drains_streams_and_answers_503_meanwhile(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = main_pids(lab)
    with Clients() as clients:
        time.sleep(3)  # streams are in flight when the release starts
        began = time.time()
        out = deploy(lab, variant(tmp_path, "slow-b", "0.04"))
        done = time.time()
        time.sleep(2)
    answered, refused = clients.check()
    after = main_pids(lab)
    assert after[ENGINE] != before[ENGINE]  # the engine was replaced
    assert after[PROXY] == before[PROXY]  # the proxy was paused and reloaded, never stopped
    assert f"pausing {PROXY}" in out and f"reloading {PROXY}" in out
    assert refused, "no request arrived during the switch"
    first, last = min(o.started for o in refused), max(o.ended for o in refused)
    # streams in flight when the proxy paused finished with all their tokens
    spanning = [o for o in answered if o.started < first < o.ended]
    assert spanning, "no stream was in flight when the proxy paused"
    # after the switch the proxy admits again
    assert [o for o in answered if o.started > last]
    outage = last - first
    drained = re.search(rf"{PROXY}: drained in (\S+)s", out)
    assert drained, out[-4000:]
    print(
        f"\nengine release: deploy {done - began:.1f} s; proxy answered 503 + Retry-After for "
        f"{outage:.1f} s ({len(refused)} requests turned away), of which the drain of the "
        f"streams in flight {drained.group(1)} s; {len(spanning)} stream(s) in flight at the "
        f"pause finished with all {TOKENS} tokens; refused/reset connections: 0"
    )


def test_a_proxy_only_release_reloads_and_drops_nothing(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = main_pids(lab)
    with Clients() as clients:
        time.sleep(3)
        began = time.time()
        out = deploy(lab, variant(tmp_path, "slow-c", "0.04", "  max_body: 8Mi\n"))
        done = time.time()
        time.sleep(2)
    answered, refused = clients.check()
    assert refused == []  # not one request turned away
    assert main_pids(lab) == before  # neither the proxy nor the engine restarted
    assert f"reloading {PROXY}" in out and f"pausing {PROXY}" not in out
    config = lab.ssh("hgx-a", "cat /etc/hgxserve/proxy.json", check=True).stdout
    assert json.loads(config)["limits"]["max_body_bytes"] == 8 << 20
    reloaded = lab.ssh(
        "hgx-a", f"journalctl -u {PROXY} --no-pager -o cat | grep -c 'reloaded /etc'"
    ).stdout.strip()
    assert int(reloaded or 0) >= 1
    spanning = [o for o in answered if o.started < began + 5 < o.ended]
    print(
        f"\nproxy-only release: deploy {done - began:.1f} s; outage 0 s; {len(answered)} "
        f"streams answered with all {TOKENS} tokens ({len(spanning)} in flight 5 s into it)"
    )


def test_a_proxy_unit_change_drains_then_restarts_the_proxy(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # a new drain bound changes the unit (TimeoutStopSec=): a reload cannot take it
    topology = variant(tmp_path, "slow-d", "0.04", "  max_body: 8Mi\n  drain_tpot_ms: 30\n")
    before = main_pids(lab)
    with Clients() as clients:
        time.sleep(3)
        began = time.time()
        out = deploy(lab, topology)
        done = time.time()
        time.sleep(2)
    failed = [o for o in clients.outcomes if o.error]
    clients.outcomes = [o for o in clients.outcomes if not o.error]
    answered, refused = clients.check()
    after = main_pids(lab)
    assert after[PROXY] != before[PROXY] and after[ENGINE] == before[ENGINE]
    assert f"pausing {PROXY}" in out
    # connections are refused only while no proxy runs: none was cut with bytes received
    assert all(o.chunks == 0 for o in failed), failed
    gone = [o for o in refused + failed]
    window = max(o.ended for o in gone) - min(o.started for o in gone) if gone else 0.0
    closed = (max(o.ended for o in failed) - min(o.started for o in failed)) if failed else 0.0
    assert [o for o in answered if o.started > max((o.ended for o in gone), default=began)]
    print(
        f"\nproxy unit release: deploy {done - began:.1f} s; clients turned away for "
        f"{window:.1f} s: {len(refused)} x 503 + Retry-After, then {len(failed)} refused "
        f"connections over {closed:.1f} s (proxy stopped until start-proxy); {len(answered)} "
        f"streams answered with all {TOKENS} tokens"
    )


def test_reapply_changes_nothing(lab: testbed_hosts.Testbed, tmp_path: Path) -> None:
    before = main_pids(lab)
    deploy(lab, variant(tmp_path, "slow-d", "0.04", "  max_body: 8Mi\n  drain_tpot_ms: 30\n"))
    assert main_pids(lab) == before


PD = REPO / "topologies/demo/demo-pd.yml"
PD_PROXY = "http://10.77.0.13:8000"
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # ~100 tokens: the P/D route (>= 64)
PD_TOKENS = 100


def pd_variant(tmp: Path, name: str, token_s: str) -> Path:
    """demo-pd with the decode's time per token: a change of the decode on hgx-b only."""
    text = PD.read_text()
    old = "    port: 8200\n"
    assert old in text
    text = text.replace(old, old + f'    env: {{HGXSERVE_SIM_TOKEN_SECONDS: "{token_s}"}}\n')
    path = tmp / f"{name}.yml"
    path.write_text(accept_simulation_env(text))
    return path


def test_engines_of_another_host_stop_only_after_the_proxy_drained(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    deploy(lab, pd_variant(tmp_path, "pd-a", "0.05"), "runtime,weights,engines")
    pids = "systemctl show -p MainPID --value hgxserve-proxy.service"
    proxy_pid = lab.ssh("hgx-c", pids, check=True).stdout.strip()
    decode = "systemctl show -p MainPID --value hgxserve-decode-0.service"
    decode_pid = lab.ssh("hgx-b", decode, check=True).stdout.strip()
    with Clients(PD_PROXY, LONG_PROMPT, PD_TOKENS) as clients:
        time.sleep(3)
        began = time.time()
        out = deploy(lab, pd_variant(tmp_path, "pd-b", "0.04"))
        done = time.time()
        time.sleep(2)
    answered, refused = clients.check()
    assert lab.ssh("hgx-b", decode, check=True).stdout.strip() != decode_pid
    assert lab.ssh("hgx-c", pids, check=True).stdout.strip() == proxy_pid  # paused, reloaded
    assert "engines on hgx-b will stop: pausing the proxy here first" in out, out[-4000:]
    assert refused, "no request arrived during the switch"
    first, last = min(o.started for o in refused), max(o.ended for o in refused)
    spanning = [o for o in answered if o.started < first < o.ended]
    assert spanning, "no stream was in flight when the proxy paused"
    assert [o for o in answered if o.started > last]
    metrics = urllib.request.urlopen(PD_PROXY + "/metrics", timeout=10).read().decode()
    assert re.search(r'hgxserve_proxy_requests_total\{route="pd"[^}]*code="2xx"\} [1-9]', metrics)
    print(
        f"\ndecode release on hgx-b, proxy on hgx-c: deploy {done - began:.1f} s; 503 + "
        f"Retry-After for {last - first:.1f} s ({len(refused)} requests); {len(spanning)} P/D "
        f"stream(s) in flight at the pause finished with all {PD_TOKENS} tokens; refused/reset "
        "connections: 0"
    )
