"""The monitoring stage on the real test hosts, read back from a real Prometheus.

The demo P/D release with `monitoring:` (tests/monitoring/demo-pd-monitored.yml: Prometheus on
hgx-c, 2 s scrapes and evaluations, 10 s alert delays) deployed through deploys/site.py; node
exporter and Prometheus are Debian's packages (preinstalled in the test hosts' rootfs, their
units disabled until the stage enables them); the DCGM exporter comes from stand-in packages of
NVIDIA's (the SIMULATED exporter, testbed/dcgm_packages.py) that the stage installs with apt
from a flat repository on each host. Then, in order: a second run changes nothing; every target
is up; while the demo serves, every recording rule and every dashboard query returns data;
stopping the decode engine fires HgxserveEngineDown, and a prefill whose NIXL side channel is on
loopback makes KV transfers fail and fires HgxserveKVTransferFailures, both read from
Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lab import api_request

from hgxserve.monitoring.dashboard import dashboard, queries
from hgxserve.monitoring.rules import rule_groups
from hgxserve.topology import load_topology
from testbed import demo
from testbed import hosts as testbed_hosts
from testbed.dcgm_packages import build_repo

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "tests/monitoring/demo-pd-monitored.yml"
PROMETHEUS = "http://10.77.0.13:9090"
PROXY = "http://10.77.0.13:8000"
REPO_DIR = "/srv/hgx-e2e-monitoring"
APT_LIST = "/etc/apt/sources.list.d/hgx-e2e-monitoring.list"
DECODE = "hgxserve-decode-0.service"
PREFILL = "hgxserve-prefill-0.service"
FAIL_DROPIN = f"/run/systemd/system/{PREFILL}.d/simulated-failure.conf"
LONG_PROMPT = "Monitoring needs a prompt long enough for the P/D route. " * 12
CLEAN = (
    "systemctl disable --now prometheus prometheus-node-exporter hgxserve-dcgm-exporter "
    ">/dev/null 2>&1; apt-mark unhold datacenter-gpu-manager-exporter "
    "datacenter-gpu-manager-4-core >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive dpkg --purge "
    "datacenter-gpu-manager-exporter datacenter-gpu-manager-4-core >/dev/null 2>&1; "
    "rm -rf /etc/systemd/system/hgxserve-dcgm-exporter.service "
    "/etc/systemd/system/prometheus-node-exporter.service.d /etc/hgxserve/monitoring "
    "/etc/prometheus/hgxserve /var/lib/prometheus/metrics2; "
    "systemctl daemon-reload; true"
)


def changes(result: subprocess.CompletedProcess[str]) -> int:
    """Operations that changed something: the Success column of pyinfra's `Grand total` row."""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    total = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    assert total, text[-3000:]
    return 0 if total.group(2) == "-" else int(total.group(2))


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if not shutil.which("dpkg-deb") or not shutil.which("dpkg-scanpackages"):
        pytest.skip("dpkg-deb/dpkg-scanpackages missing (apt-get install dpkg-dev)")
    work = tmp_path_factory.mktemp("monitoring")
    repo = build_repo(work)
    for name in testbed.names:
        testbed.ssh(name, demo.FORGET_RELEASES + "; " + CLEAN, check=True)
        target = testbed.host(name).merged / REPO_DIR.lstrip("/")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(repo, target)
        # the hosts' package mirror: a flat repo; no internet, so no Debian mirror either
        testbed.ssh(
            name,
            f"echo 'deb [trusted=yes] file:{REPO_DIR} ./' > {APT_LIST}; "
            "[ -f /etc/apt/sources.list ] && "
            "mv /etc/apt/sources.list /etc/apt/sources.list.hgx-e2e; "
            "rm -f /var/lib/apt/periodic/update-success-stamp; true",
            check=True,
        )
    demo.prepare(testbed.names, work)
    yield testbed
    stop_load.set()
    demo.stop_s3()
    for name in testbed.names:
        testbed.ssh(
            name,
            f"rm -f {FAIL_DROPIN}; " + demo.FORGET_RELEASES + "; " + CLEAN + f"; rm -rf "
            f"{REPO_DIR} {APT_LIST}; mv /etc/apt/sources.list.hgx-e2e /etc/apt/sources.list "
            "2>/dev/null; true",
        )


def deploy(bed: testbed_hosts.Testbed, stages: str) -> subprocess.CompletedProcess[str]:
    return bed.pyinfra(
        "deploys/site.py",
        "--data", f"topology={TOPOLOGY}",
        "--data", f"stages={stages}",
        "--data", "health_timeout=75",
        "--data", "confirm_within=120",
    )  # fmt: skip


def prom(path: str, **params: str) -> Any:
    url = f"{PROMETHEUS}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (test host address)
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def query(expr: str) -> list[dict[str, Any]]:
    return prom("/api/v1/query", query=expr)["result"]


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # Prometheus (re)starting
            last = exc
        if last and not isinstance(last, OSError):
            return last
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def complete(prompt: str, max_tokens: int = 16) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    request = api_request(f"{PROXY}/v1/completions", body)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310 (test host)
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


stop_load = threading.Event()
load_seen: dict[str, int] = {}  # what the load got: status codes and errors, by count


def serve_load() -> threading.Thread:
    """The demo serving: short prompts (combined engine) and long ones (prefill -> decode)."""
    # another module sharing this module's `lab` fixture (test_metrics_key_e2e) set the event
    # in its teardown: a load started after it would stop at once
    stop_load.clear()

    def run() -> None:
        i = 0
        while not stop_load.is_set():
            try:
                code = complete(f"Only answer: ok{i}" if i % 2 else f"{LONG_PROMPT} {i}")
                load_seen[str(code)] = load_seen.get(str(code), 0) + 1
            except OSError as exc:
                load_seen[repr(exc)[:160]] = load_seen.get(repr(exc)[:160], 0) + 1
                time.sleep(0.5)
            i += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def firing(alertname: str, **labels: str) -> list[dict[str, Any]]:
    return [
        a
        for a in prom("/api/v1/alerts")["alerts"]
        if a["labels"].get("alertname") == alertname
        and a["state"] == "firing"
        and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def has_value(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def test_monitoring_stage_converges_then_changes_nothing(lab: testbed_hosts.Testbed) -> None:
    first = deploy(lab, "runtime,weights,engines,monitoring")
    assert changes(first) > 0
    again = lab.pyinfra("deploys/monitoring.py", "--data", f"topology={TOPOLOGY}")
    assert changes(again) == 0, again.stdout[-3000:]
    for name in lab.names:
        active = lab.ssh(
            name, "systemctl is-active prometheus-node-exporter hgxserve-dcgm-exporter"
        )
        assert active.stdout.split() == ["active", "active"], (name, active.stdout)
        held = lab.ssh(name, "apt-mark showhold").stdout.split()
        assert "datacenter-gpu-manager-exporter" in held
        # the package's own unit stays off: ours runs the pinned binary with our sandbox
        vendor = lab.ssh(name, "systemctl is-enabled nvidia-dcgm-exporter").stdout.strip()
        assert vendor == "disabled"
    assert lab.ssh("hgx-c", "systemctl is-active prometheus").stdout.strip() == "active"
    assert lab.ssh("hgx-a", "systemctl is-active prometheus").stdout.strip() == "inactive"
    # rules of a topology this Prometheus no longer serves are removed (and Prometheus reloaded)
    stale = "/etc/prometheus/hgxserve/rules/old-topology.rules.yml"
    lab.ssh("hgx-c", f"printf 'groups: []\\n' > {stale}", check=True)
    cleanup = lab.pyinfra(
        "deploys/monitoring.py", "--limit", "hgx-c", "--data", f"topology={TOPOLOGY}"
    )
    assert changes(cleanup) > 0
    assert lab.ssh("hgx-c", f"test -e {stale}").returncode == 1


def test_every_target_is_up(lab: testbed_hosts.Testbed) -> None:
    def all_up() -> list[dict[str, Any]] | None:
        targets = prom("/api/v1/targets")["activeTargets"]
        ours = [t for t in targets if t["labels"].get("topology") == "demo-pd"]
        return ours if len(ours) == 10 and all(t["health"] == "up" for t in ours) else None

    targets = wait_for(all_up, "all 10 targets up", timeout=90)
    jobs = sorted({t["labels"]["job"] for t in targets})
    assert jobs == ["hgxserve-dcgm", "hgxserve-engine", "hgxserve-node", "hgxserve-proxy"]
    engines = {t["labels"]["engine"]: t["labels"] for t in targets if "engine" in t["labels"]}
    assert engines["decode-0"]["role"] == "decode" and engines["decode-0"]["gpus"] == "0,1,2,3"
    assert engines["decode-0"]["host"] == "hgx-b"
    # the simulated DCGM exporter answers with DCGM's field names and labels, per GPU
    gpus = query('DCGM_FI_DEV_FB_USED{topology="demo-pd",host="hgx-b"}')
    assert len(gpus) == 8 and all(g["metric"]["modelName"] == "NVIDIA H200" for g in gpus)


def test_recording_rules_and_dashboard_queries_return_data(lab: testbed_hosts.Testbed) -> None:
    serve_load()
    topo = load_topology(str(TOPOLOGY))
    # upstream errors are recorded once there are some: the proxy exports no series before
    records = sorted(
        {r["record"] for g in rule_groups(topo) for r in g["rules"] if "record" in r}
        - {"instance:hgxserve_proxy_upstream_errors:rate"}
    )

    def every_rule() -> bool:
        return all(has_value(query(name + '{topology="demo-pd"}')) for name in records)

    try:
        wait_for(every_rule, "every recording rule to return a value while serving", 120)
    except AssertionError:
        empty = [n for n in records if not has_value(query(n + '{topology="demo-pd"}'))]
        raise AssertionError(
            f"recording rules without data: {empty}; the load got {load_seen}"
        ) from None
    tokens = query('role:hgxserve_generation_tokens_per_gpu:rate{topology="demo-pd"}')
    assert {r["metric"]["role"] for r in tokens} == {"prefill", "decode", "combined"}
    assert any(float(r["value"][1]) > 0 for r in tokens)
    board = dashboard(topo)
    exprs = [q.replace("$topology", "demo-pd") for q in queries(board)]
    empty = [e for e in exprs if not query(e)]
    assert empty == [], f"dashboard queries without data: {empty}"
    print(f"{len(records)} recording rules and {len(exprs)} dashboard queries returned data")
    stop_load.set()


def test_stopping_the_decode_fires_engine_down(lab: testbed_hosts.Testbed) -> None:
    lab.ssh("hgx-b", f"systemctl stop {DECODE}", check=True)
    try:
        started = time.monotonic()
        alerts = wait_for(
            lambda: firing("HgxserveEngineDown", engine="decode-0"),
            "HgxserveEngineDown for decode-0",
            timeout=90,
        )
        print(f"HgxserveEngineDown fired {time.monotonic() - started:.1f} s after the stop")
        (alert,) = alerts
        assert alert["labels"]["role"] == "decode" and alert["labels"]["host"] == "hgx-b"
        assert "Fabric Manager" in alert["annotations"]["runbook"]
    finally:
        lab.ssh("hgx-b", f"systemctl start {DECODE}", check=True)
    wait_for(
        lambda: not firing("HgxserveEngineDown") and query('up{engine="decode-0"} == 1'),
        "the decode back up and the alert resolved",
        timeout=120,
    )


def test_a_kv_transfer_failure_fires_its_alert(lab: testbed_hosts.Testbed) -> None:
    dropin = (
        f"mkdir -p {Path(FAIL_DROPIN).parent} && printf '%s\\n' '[Service]' "
        "'Environment=HGXSERVE_SIM_FAIL=loopback_side_channel' > "
        f"{FAIL_DROPIN} && systemctl daemon-reload && systemctl restart {PREFILL}"
    )
    lab.ssh("hgx-a", dropin, check=True)
    try:
        wait_for(lambda: query('up{engine="prefill-0"} == 1'), "the prefill back", 60)
        started = time.monotonic()
        codes = []
        for _ in range(30):
            if firing("HgxserveKVTransferFailures"):
                break
            codes.append(complete(LONG_PROMPT))  # policy recompute: the client still gets 200
            time.sleep(1)
        assert 200 in codes, codes
        alerts = wait_for(
            lambda: firing("HgxserveKVTransferFailures", engine="decode-0"),
            "HgxserveKVTransferFailures for decode-0",
            timeout=60,
        )
        print(f"HgxserveKVTransferFailures fired {time.monotonic() - started:.1f} s after load")
        assert "loopback" in alerts[0]["annotations"]["runbook"]
        failed = query('vllm:nixl_num_failed_transfers_total{engine="decode-0"}')
        assert failed and float(failed[0]["value"][1]) > 0
    finally:
        lab.ssh(
            "hgx-a",
            f"rm -f {FAIL_DROPIN}; systemctl daemon-reload; systemctl restart {PREFILL}",
        )
