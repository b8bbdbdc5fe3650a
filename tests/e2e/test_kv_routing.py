"""KV-aware routing end to end on the real test hosts: the real pyinfra CLI over SSH, real systemd
units running two combined simulated engines (one beside the proxy on hgx-a, one on hgx-b,
reached through the host firewall), each publishing KV events over ZMQ as rendered from the
topology's port plan, and the real proxy subscribing to them and tokenizing with the model's own
tokenizer from the weights on its host.

Chat requests that share a long system prompt must be routed by the blocks the engines report:
the proxy's /metrics counts cache-hit decisions with cached prompt tokens, the engines' own
prefix-cache hit counters rise, and a second deploy of the same topology changes nothing.

Skipped, with the reason, where a part is missing: a simulated engine without KV events, a proxy
without the kv-events policy, or test hosts whose image lacks the ZMQ/msgpack modules the
simulated engine publishes with.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import api_request, demo_lab, output, site, units

from testbed import demo, simengine
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e
Lab = tuple[testbed_hosts.Testbed, Path]  # the hosts and the topology file

REPO = Path(__file__).resolve().parents[2]
PROXY = "http://10.77.0.11:8000"
ENGINES = {"combined-0": ("hgx-a", 8100), "combined-1": ("hgx-b", 8200)}
# 144 bytes: nine 16-token blocks of the simulated engine's byte tokens, the same for every request
SYSTEM = (
    "You are the hgxserve lab assistant. Answer in one short line, cite the runbook section, "
    "and never guess a port number you were not told."
)
QUESTIONS = 8
# metric names of the proxy (hgxserve/proxy/kvroute.py) and of the simulated vLLM engine
DECISIONS = "hgxserve_proxy_route_decisions_total"
MATCHED = "hgxserve_proxy_prompt_match_total"
CACHED_SUM = "hgxserve_proxy_cached_prompt_tokens_sum"
KV_EVENTS = "hgxserve_proxy_kv_events_total"
INDEX_BLOCKS = "hgxserve_proxy_kv_index_blocks"
ENGINE_HITS = "vllm:prefix_cache_hits_total"

TOPOLOGY = """\
# Two combined simulated engines behind the hgxserve proxy with policy kv-events: combined-0
# beside the proxy on hgx-a, combined-1 on hgx-b.
name: demo-kv-routing
description: Demo lab KV-aware routing, two combined engines (hgx-a, hgx-b), proxy on hgx-a
hosts:
  hgx-a: {address: 10.77.0.11, gpu: H200, gpus: 8}
  hgx-b: {address: 10.77.0.12, gpu: H200, gpus: 8}
  hgx-c: {address: 10.77.0.13, gpu: H200, gpus: 8}
model:
  name: tiny
  served_name: tiny
  path: /models/tiny
  source:
    s3:
      endpoint: http://10.77.0.1:9000
      bucket: models
      prefix: tiny/
      addressing: path
      credentials: {env_file: /etc/hgxserve/s3.env}
defaults:
  engine: vllm
  version: 0.26.0
  runtime: {venv: /opt/vllm-sim}
  args:
    max_model_len: 256
    max_num_seqs: 8
    block_size: 16
engines:
  combined-0: {role: combined, place: {hgx-a: [0, 1, 2, 3]}, tp: 4, port: 8100}
  combined-1: {role: combined, place: {hgx-b: [0, 1, 2, 3]}, tp: 4, port: 8200}
proxy:
  host: hgx-a
  listen: 0.0.0.0:8000
  auth:
    api_key: {credential: hgxserve-api-key}
    engine_api_key: {credential: hgxserve-engine-key}
  combined: [combined-0, combined-1]
  routing: {policy: kv-events, tokenizer: weights}
warmup:
  - {input: 64, output: 16, concurrency: 4}
"""


def missing_capability() -> str | None:
    """Why the parts this test needs are not all here (None: they are), read from the code
    itself, not from a branch name."""
    if not hasattr(simengine, "KvEventPublisher"):
        return "the simulated engine publishes no KV events (testbed/simengine.py)"
    if not hasattr(demo, "byte_tokenizer_json"):
        return "the demo model ships no tokenizer.json for the proxy (testbed/demo.py)"
    from hgxserve.proxy import config as proxy_config

    fields = {f.name for f in dataclasses.fields(proxy_config.Routing)}
    if not {"policy", "tokenizer_dir"} <= fields:
        return "the proxy has no kv-events routing policy (hgxserve/proxy/config.py)"
    return None


@pytest.fixture(scope="module")
def lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = missing_capability()
    if why:
        pytest.skip(why)
    testbed: testbed_hosts.Testbed = request.getfixturevalue("testbed")
    for name in ("hgx-a", "hgx-b"):
        probe = testbed.ssh(name, "python3 -c 'import zmq, msgpack'")
        if probe.returncode != 0:
            pytest.skip(
                f"{name} lacks python3-zmq/python3-msgpack, which the simulated engine publishes "
                "KV events with: the test hosts' image predates them (testbed/rootfs.py)"
            )
    work = tmp_path_factory.mktemp("kv")
    with demo_lab(testbed, work) as bed:
        yield bed, _topology(work)


def _topology(work: Path) -> Path:
    path = work / "demo-kv-routing.yml"
    path.write_text(TOPOLOGY)
    return path


def samples(text: str, name: str, **labels: str) -> list[float]:
    """Values of `name` whose labels include `labels` (Prometheus text format)."""
    out = []
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            out.append(float(match.group(2)))
    return out


def proxy_metrics() -> str:
    with urllib.request.urlopen(f"{PROXY}/metrics", timeout=10) as resp:
        return resp.read(1 << 22).decode()


def engine_hits(lab: testbed_hosts.Testbed) -> dict[str, float]:
    """Each engine's prefix-cache hit tokens, read on its own host (combined-0 listens on
    loopback beside the proxy)."""
    out = {}
    for name, (host, port) in ENGINES.items():
        read = (
            "python3 -c 'import urllib.request as u; "
            f'print(u.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read(1 << 22)'
            ".decode())'"
        )
        proc = lab.ssh(host, read, check=True)
        out[name] = sum(samples(proc.stdout, ENGINE_HITS))
    return out


def chat(question: str) -> dict:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    req = api_request(f"{PROXY}/v1/chat/completions", body)
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return json.loads(resp.read(1 << 20))


def wait_for(check, what: str, timeout: float = 30.0) -> str:  # type: ignore[no-untyped-def]
    """Poll the proxy's /metrics until `check(text)` holds; its last text."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = proxy_metrics()
        if check(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:.0f} s; /metrics:\n{text[-3000:]}")


def test_shared_prefix_requests_go_where_the_engines_report_it_cached(lab: Lab) -> None:
    bed, topology = lab
    proc = site(bed, topology)
    assert proc.returncode == 0, output(proc)[-4000:]
    # both engines' publishers reached: the one beside the proxy on loopback, hgx-b's through
    # its firewall (the warm-up's blocks come by replay or live)
    wait_for(
        lambda t: all(
            sum(samples(t, KV_EVENTS, instance=f"http://{url}", type="BlockStored")) > 0
            for url in ("127.0.0.1:8100", "10.77.0.12:8200")
        ),
        "BlockStored events from both engines",
    )
    before = engine_hits(bed)
    indexed = sum(samples(proxy_metrics(), INDEX_BLOCKS))
    first = chat("question 0: which port does the proxy listen on?")
    assert first["choices"][0]["message"]["content"]
    # the first request's blocks (the system prompt's among them) reach the proxy's index
    # before the others are sent: the engine publishes them as it stores them
    wait_for(
        lambda t: sum(samples(t, INDEX_BLOCKS)) >= indexed + 10,
        "the first request's blocks in the proxy's index",
        timeout=10,
    )
    for i in range(1, QUESTIONS):
        assert chat(f"question {i}: what does section {i} cover?")["choices"]
    text = proxy_metrics()
    hits = sum(samples(text, DECISIONS, route="combined", reason="cache-hit"))
    assert hits >= QUESTIONS - 1, text[-3000:]
    assert sum(samples(text, MATCHED, path="tokens")) >= QUESTIONS, text[-3000:]
    # the shared system prompt: at least its nine full blocks cached on every hit
    assert sum(samples(text, CACHED_SUM)) >= (QUESTIONS - 1) * 144, text[-3000:]
    after = engine_hits(bed)
    assert sum(after.values()) > sum(before.values()), (before, after)
    print(f"kv routing: {hits:.0f} cache-hit decisions, engine hits {before} -> {after}")


def test_second_deploy_changes_nothing(lab: Lab) -> None:
    bed, topology = lab
    before = {h: units(bed, h) for h in ("hgx-a", "hgx-b")}
    proc = site(bed, topology)
    assert proc.returncode == 0, output(proc)[-4000:]
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(proc))
    assert match, output(proc)[-3000:]
    assert (match.group(2), match.group(3)) == ("-", "-"), output(proc)[-3000:]
    assert {h: units(bed, h) for h in ("hgx-a", "hgx-b")} == before  # nothing restarted
