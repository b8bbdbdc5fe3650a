"""An SGLang prefill binds its disaggregation bootstrap server to --host (SGLang's
CommonKVBootstrapServer takes `server_args.host`): a decode on another host dials it, so the
prefill never binds loopback then, `plan` shows both sockets on that one address, and the
address handed to the decodes is one they reach."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, flag_pairs, topology

from hgxserve.plan.report import build_plan
from hgxserve.render import render_host
from hgxserve.topology import check_topology, load_topology
from hgxserve.topology.ports import bootstrap_address, engine_bind, listeners_by_host

SAME_HOST = """\
name: sglang-same-host
hosts:
  h-a: {address: 10.0.0.11, gpu: H20}
model: {name: m, served_name: m, path: /models/m, source: {local: {path: /models/m}}}
defaults:
  engine: sglang
  version: 0.5.17
  runtime: {venv: /opt/sglang}
  args: {max_num_seqs: 32, block_size: 64}
engines:
  prefill-0: {role: prefill, place: {h-a: [0, 1, 2, 3]}, tp: 4, port: 30000,
              kv: {connector: mooncake, bootstrap_port: 8998}}
  decode-0: {role: decode, place: {h-a: [4, 5, 6, 7]}, tp: 4, port: 30001,
             kv: {connector: mooncake}}
proxy:
  host: h-a
  routes:
    - {prefill: [prefill-0], decode: [decode-0]}
"""


def _sockets(topo, host: str, owner: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {li.what: li.bind for li in listeners_by_host(topo)[host] if li.owner == owner}


def test_cross_host_prefill_beside_the_proxy_binds_where_the_decode_reaches() -> None:
    topo = topology("h20-v4flash-sglang-1p1d.yml")
    prefill = topo.engines["prefill-0"]
    assert engine_bind(topo, prefill) == "0.0.0.0"
    unit = render_host(topo, "h20-a").units[0]
    flags = dict(flag_pairs(unit.argv))
    assert flags["--host"] == "0.0.0.0"
    assert flags["--disaggregation-bootstrap-port"] == "8998"
    assert "SGLang binds its disaggregation bootstrap server (port 8998) to --host" in unit.content
    # the port plan and `plan` show the two sockets SGLang binds to --host on one address
    assert _sockets(topo, "h20-a", "prefill-0") == {
        "HTTP API": "0.0.0.0",
        "SGLang bootstrap": "0.0.0.0",
        "KV events (dp rank 0)": "0.0.0.0",
        "KV events replay (dp rank 0)": "0.0.0.0",  # where the HTTP API binds
    }
    shown = build_plan(topo)["hosts"]["h20-a"]["listeners"]
    assert {(li["port"], li["bind"]) for li in shown if li["owner"] == "prefill-0"} == {
        (30000, "0.0.0.0"),
        (8998, "0.0.0.0"),
        (50000, "0.0.0.0"),
        (51000, "0.0.0.0"),
    }
    # the proxy beside it still dials loopback; the decode on h20-b gets the host's address
    config = json.loads(render_host(topo, "h20-a").files["/etc/hgxserve/proxy.json"].content)
    assert config["pd_groups"][0]["prefill"] == [
        {
            "url": "http://127.0.0.1:30000",
            "kv_events": {
                "publishers": ["tcp://127.0.0.1:50000"],
                "replays": ["tcp://127.0.0.1:51000"],
                "topic": "kv-events",
            },
            "bootstrap_host": "10.0.0.11",
            "bootstrap_port": 8998,
        }
    ]
    assert bootstrap_address(topo, prefill) == "10.0.0.11"


def test_same_host_pd_stays_on_loopback_and_hands_out_loopback(tmp_path: Path) -> None:
    path = tmp_path / "same.yml"
    path.write_text(SAME_HOST)
    topo = load_topology(path)
    prefill = topo.engines["prefill-0"]
    assert engine_bind(topo, prefill) == "127.0.0.1"
    assert _sockets(topo, "h-a", "prefill-0") == {
        "HTTP API": "127.0.0.1",
        "SGLang bootstrap": "127.0.0.1",
        "KV events (dp rank 0)": "0.0.0.0",  # SGLang binds a PUB endpoint only as a wildcard
        "KV events replay (dp rank 0)": "127.0.0.1",
    }
    # a loopback-bound bootstrap server answers only on loopback: that is what the decode dials
    config = json.loads(render_host(topo, "h-a").files["/etc/hgxserve/proxy.json"].content)
    assert config["pd_groups"][0]["prefill"][0]["bootstrap_host"] == "127.0.0.1"
    unit = render_host(topo, "h-a").units[0]
    assert dict(flag_pairs(unit.argv))["--host"] == "127.0.0.1"
    assert "bootstrap server" not in unit.content


def test_a_written_loopback_bind_with_a_decode_elsewhere_is_refused() -> None:
    case = ROOT / "tests" / "topology" / "invalid" / "reachable-bootstrap.yml"
    problems = [p for p in check_topology(case).problems if p.rule == "reachable"]
    assert len(problems) == 1
    assert problems[0].path == ("engines", "prefill-0", "bind")
    assert "bootstrap server (port 8998)" in problems[0].message
    assert "decode-0 on h-b" in problems[0].message
