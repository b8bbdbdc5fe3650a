"""`hgxserve status` verdicts: host answers (as `hgxserve inspect` prints them) against the
demo P/D topology, one broken thing at a time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from hgxserve.caches.key import cache_key
from hgxserve.release.plan import plan_release
from hgxserve.remote.ssh import Result
from hgxserve.status.report import build_report, inspect_argv
from hgxserve.status.table import render
from hgxserve.topology import load_topology
from hgxserve.topology.ports import engine_url

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
NOW = 1_800_000_000.0
MARKER = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def topo() -> Any:
    return load_topology(PD)


def healthy(topo: Any, host: str) -> dict[str, Any]:
    """What `hgxserve inspect` prints on `host` when the topology's release runs fine."""
    plan = plan_release(topo, host)
    units = []
    gpus = [
        {"index": i, "name": "NVIDIA H200", "memory_used_mib": 0, "memory_total_mib": 143771,
         "utilization": "0%", "processes": []}
        for i in range(8)
    ]  # fmt: skip
    for pid, unit in enumerate(plan.spec.units, start=100):
        units.append(
            {"name": unit.name, "kind": unit.kind, "gpus": unit.gpus,
             "health_url": unit.health_url, "loaded": "loaded", "active": "active",
             "sub": "running", "result": "success", "restarts": 0, "main_pid": pid,
             "exit_status": 0, "need_reload": False, "since": NOW - 60,
             "health": "ok", "health_detail": ""}
        )  # fmt: skip
        for g in unit.gpus:
            gpus[g]["memory_used_mib"] = 129000
            gpus[g]["processes"].append(
                {"pid": pid, "name": "python3", "used_memory_mib": 129000, "unit": unit.name}
            )
    engines = topo.engines_on(host)
    snap: dict[str, Any] = {
        "host": host,
        "release": {
            "current": plan.id,
            "previous": None,
            "baseline": None,
            "pending": None,
            "releases": [plan.id],
            "running": plan.id,
            "error": None,
            "topology": topo.name,
        },  # fmt: skip
        "units": units,
        "drift": {"modified": [], "missing": [], "stray_units": []},
        "gpus": {"status": "ok", "driver_version": "570.158.01", "gpus": gpus},
        "weights": {
            "path": "/models/tiny",
            "marker": MARKER,
            "intact": True,
            "source": "s3://models/tiny/",
            "detail": "ok",
        }
        if engines
        else None,
        "caches": {
            cache_key(topo, e): {"present": True, "restored": False, "baked": False}
            for e in engines
        },  # fmt: skip
        "proxy": None,
    }
    if host == topo.proxy.host:
        snap["proxy"] = {
            "url": "http://127.0.0.1:8000",
            "known": True,
            "started": NOW - 120,
            "instances": [
                {
                    "url": engine_url(topo, e),
                    "role": e.role,
                    "in_rotation": True,
                    "since": NOW - 100,
                    "outstanding": 0,
                }
                for e in topo.engines.values()
            ],  # fmt: skip
            "kv_handoffs": {"ok": 4},
            "decisions": {"combined/cache-hit": 7, "pd/load": 1},
        }
    return snap


def answers(topo: Any, **changed: dict[str, Any]) -> dict[str, Result]:
    out = {}
    for host in topo.hosts:
        snap = changed.get(host.replace("-", "_")) or healthy(topo, host)
        out[host] = Result(host, True, 0, json.dumps(snap), elapsed_s=0.2)
    return out


def report(topo: Any, results: dict[str, Result], **kw: Any) -> Any:
    return build_report(topo, str(PD), results, now=NOW, **kw)


def messages(rep: Any) -> list[str]:
    return [p.line() for p in rep.problems]


def test_everything_as_the_topology_says_is_healthy(topo: Any) -> None:
    rep = report(topo, answers(topo))
    assert rep.exit_code == 0 and rep.verdict == "healthy", messages(rep)
    text = render(rep, topo)
    assert text.startswith("demo-pd  HEALTHY  3/3 hosts")
    assert "decode-0" in text and "PROXY hgx-c" in text and "PROBLEMS" not in text
    assert "0-3 decode-0 503/561 GiB" in text  # GPUs 0-3 held by the decode on hgx-b
    assert "Routing since start: combined/cache-hit 7, pd/load 1" in text


def test_stopped_decode_names_host_unit_and_proxy_ejection(topo: Any) -> None:
    b = healthy(topo, "hgx-b")
    b["units"][0].update(active="inactive", sub="dead", health="failing",
                         health_detail="connection refused")  # fmt: skip
    c = healthy(topo, "hgx-c")
    decode = next(i for i in c["proxy"]["instances"] if i["role"] == "decode")
    decode.update(in_rotation=False, reason="3 failed health check(s) of /health: "
                  "connection refused", since=NOW - 5)  # fmt: skip
    rep = report(topo, answers(topo, hgx_b=b, hgx_c=c))
    assert rep.exit_code == 1
    lines = messages(rep)
    assert "hgx-b: hgxserve-decode-0.service is inactive (dead)" in lines
    assert any(
        line.startswith("hgx-c: proxy has decode-0 (http://10.77.0.12:8200) out of rotation")
        and "connection refused" in line
        for line in lines
    ), lines
    assert "OUT" in render(rep, topo)


def test_pending_switch_shows_its_revert_deadline(topo: Any) -> None:
    a = healthy(topo, "hgx-a")
    a["release"]["pending"] = {"id": a["release"]["running"], "previous": "0" * 12,
                               "since": NOW - 10, "deadline": NOW + 290}  # fmt: skip
    a["release"]["deadman"] = {"armed": True, "fires_at": NOW + 300}
    rep = report(topo, answers(topo, hgx_a=a))
    assert rep.exit_code == 1
    clock = time.strftime("%H:%M:%S", time.localtime(NOW + 300))
    assert f"reverts at {clock} (in 5 min) unless confirmed" in messages(rep)[0]
    assert f"reverts {clock} (in 5 min)" in render(rep, topo)
    a["release"]["deadman"] = {"armed": False, "fires_at": None}
    rep = report(topo, answers(topo, hgx_a=a))
    assert "the dead-man timer is NOT armed" in messages(rep)[0]


def test_unreachable_host_means_could_not_tell(topo: Any) -> None:
    results = answers(topo)
    results["hgx-a"] = Result("hgx-a", False, error="no answer (timed out): timed out")
    b = healthy(topo, "hgx-b")
    b["units"][0]["active"] = "failed"
    results["hgx-b"] = Result("hgx-b", True, 0, json.dumps(b))
    rep = report(topo, results)
    assert rep.exit_code == 2 and rep.verdict == "unknown"  # unknown wins over degraded
    assert "hgx-a: unreachable: no answer (timed out): timed out" in messages(rep)
    assert "hgx-a  10.77.0.11  UNREACHABLE" in render(rep, topo)


@pytest.mark.parametrize(
    ("status", "stderr", "expected"),
    [
        (127, "sh: 1: /opt/hgxserve/bin/hgxserve: not found", "hgxserve is not installed"),
        (2, "Error: No such command 'inspect'.", "has no `inspect` (older agent)"),
    ],
)
def test_a_host_that_cannot_answer_means_could_not_tell(
    topo: Any, status: int, stderr: str, expected: str
) -> None:
    results = answers(topo)
    results["hgx-c"] = Result("hgx-c", True, status, "", stderr)
    rep = report(topo, results)
    assert rep.exit_code == 2 and expected in messages(rep)[0]


def test_another_topologys_release_is_not_healthy(topo: Any) -> None:
    a = healthy(topo, "hgx-a")
    a["release"].update(running="0123456789ab", current="0123456789ab", topology="demo-baseline")
    rep = report(topo, answers(topo, hgx_a=a))
    assert rep.exit_code == 1
    assert "runs release 0123456789ab (demo-baseline), not this topology's release" in (
        messages(rep)[0])  # fmt: skip


def test_drift_is_degraded(topo: Any) -> None:
    c = healthy(topo, "hgx-c")
    c["drift"] = {"modified": ["/etc/hgxserve/proxy.json"], "missing": [],
                  "stray_units": ["hgxserve-old-0.service"]}  # fmt: skip
    c["units"][0]["need_reload"] = True
    rep = report(topo, answers(topo, hgx_c=c))
    assert rep.exit_code == 1
    assert {p.part for p in rep.problems} == {"drift"}
    assert len(rep.problems) == 3


def test_gpu_held_by_a_foreign_process(topo: Any) -> None:
    a = healthy(topo, "hgx-a")
    a["gpus"]["gpus"][2]["processes"].append(
        {"pid": 4242, "name": "python", "used_memory_mib": 8000, "unit": None}
    )
    rep = report(topo, answers(topo, hgx_a=a))
    assert messages(rep) == [
        "hgx-a: GPU 2 of hgxserve-prefill-0.service is held by a process outside any hgxserve "
        "unit (pid 4242, 8000 MiB)"
    ]


def test_weights_marker_against_pin_source_and_other_hosts(topo: Any) -> None:
    assert report(topo, answers(topo), weights_digest=MARKER).exit_code == 0
    rep = report(topo, answers(topo), weights_digest="sha256:" + "cd" * 32)
    assert len(rep.problems) == 3 and "is verified for sha256:abab" in messages(rep)[0]
    b = healthy(topo, "hgx-b")
    b["weights"]["marker"] = "sha256:" + "ef" * 32
    rep = report(topo, answers(topo, hgx_b=b))
    assert messages(rep) == [
        f"hosts hold different weights: hgx-a {MARKER}, hgx-b sha256:{'ef' * 32}, hgx-c {MARKER}"
    ]
    b = healthy(topo, "hgx-b")
    b["weights"].update(marker=None, intact=False, detail="/models/tiny: not verified")
    assert messages(report(topo, answers(topo, hgx_b=b))) == ["hgx-b: /models/tiny: not verified"]


def test_failed_kv_transfers_are_a_warning(topo: Any) -> None:
    b = healthy(topo, "hgx-b")
    b["units"][0]["metrics"] = {"kv_transfers": 10.0, "kv_failed": 2.0}
    rep = report(topo, answers(topo, hgx_b=b))
    assert rep.exit_code == 0
    assert messages(rep) == [
        "hgx-b: hgxserve-decode-0.service counted 2 failed KV transfers since it started"
    ]
    assert "decode-0 transfers 10, failed 2" in render(rep, topo)


def test_inspect_command_quotes_nothing_it_does_not_need(topo: Any) -> None:
    argv = inspect_argv(topo, "hgx-b", "/opt/hgxserve/bin/hgxserve")
    assert argv[:4] == ["/opt/hgxserve/bin/hgxserve", "inspect", "--cache-root",
                        "/var/cache/hgxserve"]  # fmt: skip
    assert "--model-path" in argv and cache_key(topo, topo.engines["decode-0"]) in argv


def test_json_report_round_trips(topo: Any) -> None:
    data = json.loads(report(topo, answers(topo)).to_json())
    assert data["verdict"] == "healthy" and data["exit_code"] == 0
    assert set(data["hosts"]) == {"hgx-a", "hgx-b", "hgx-c"}
    assert data["hosts"]["hgx-b"]["snapshot"]["units"][0]["name"] == "hgxserve-decode-0.service"


def test_start_time_and_kv_capacity_from_the_release_record(topo: Any) -> None:
    b = healthy(topo, "hgx-b")
    b["units"][0]["observed"] = {
        "start_s": 41.2, "kv_tokens": 1_760_000, "kv_source": "metrics", "kv_fit_ratio": 0.97,
        "kv_need_tokens": 1088, "kv_verdict": "ok", "kv_message": "decode-0 holds ...",
    }  # fmt: skip
    a = healthy(topo, "hgx-a")
    a["units"][0]["observed"] = {
        "start_s": 3.0, "kv_tokens": 128, "kv_source": "log", "kv_fit_ratio": None,
        "kv_need_tokens": 964, "kv_verdict": "short",
        "kv_message": "prefill-0 (hgxserve-prefill-0.service) holds 128 KV tokens ..., below "
        "the 964 its largest shape needs (bench pd-long c4: 4 x (240+1))",
    }  # fmt: skip
    rep = report(topo, answers(topo, hgx_a=a, hgx_b=b))
    assert rep.exit_code == 0  # released under gate.kv_capacity: warn: said, not degraded
    assert messages(rep) == [
        "hgx-a: KV capacity: prefill-0 (hgxserve-prefill-0.service) holds 128 KV tokens ..., "
        "below the 964 its largest shape needs (bench pd-long c4: 4 x (240+1))"
    ]
    text = render(rep, topo)
    assert "STARTED IN" in text and "KV" in text
    decode = next(line for line in text.splitlines() if line.startswith("decode-0"))
    assert "41s" in decode.split() and decode.endswith("1.76M tok (0.97x fit)"), decode
    prefill = next(line for line in text.splitlines() if line.startswith("prefill-0"))
    assert "3s" in prefill.split() and prefill.endswith("128 tok SHORT of 964"), prefill
    data = json.loads(rep.to_json())
    observed = data["hosts"]["hgx-b"]["snapshot"]["units"][0]["observed"]
    assert observed["start_s"] == 41.2 and observed["kv_tokens"] == 1_760_000
