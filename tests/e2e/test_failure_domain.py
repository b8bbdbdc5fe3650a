"""A multi-node engine is one failure domain, on the real test hosts.

topologies/demo/demo-multinode.yml: one (simulated) vLLM engine of two DP ranks spanning hgx-a
(head: API server, DP coordinator) and hgx-b (headless worker, a real process that joined the
head over TCP), the proxy on hgx-c. Deployed with the real pyinfra CLI through the release
stage. Then the worker's main process is killed with SIGKILL: the head dies with it (as vLLM's
head does when a DP engine dies), the watcher on hgx-a restarts the engine as a whole (the
worker first, then the head, which serves only once the worker joined it again), the proxy
takes it out of rotation and back, and `hgxserve status` shows the watcher's event. Then the
head is killed: the worker hangs (as in NCCL) until the watcher restarts both. A second deploy
with nothing changed changes nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import demo_lab

from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "topologies/demo/demo-multinode.yml"
HGXSERVE = str(REPO / ".venv/bin/hgxserve")
ENGINE_UNIT = "hgxserve-combined-0.service"
WATCH_UNIT = "hgxserve-combined-0-watch.service"
PROXY = "http://10.77.0.13:8000"
ENGINE = "http://10.77.0.11:8300"
# Killing a member to serving again: the watcher notices within a poll (2 s), the worker's
# restart (its stop, GPUs released), the head's start (2 s simulated start + its checks) and
# its wait for the worker; 120 s leaves room for a loaded machine running three test hosts.
RECOVERY_BOUND_S = 120.0


def _deploy(lab: testbed_hosts.Testbed) -> subprocess.CompletedProcess[str]:
    return lab.pyinfra(
        "deploys/site.py",
        "--data", f"topology={TOPOLOGY}",
        "--data", "stages=runtime,weights,engines",
        "--data", "health_timeout=120",
        "--data", "confirm_within=120",
    )  # fmt: skip


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with demo_lab(testbed, tmp_path_factory.mktemp("failure-domain")) as bed:
        proc = _deploy(bed)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        yield bed


def _show(lab: testbed_hosts.Testbed, host: str, unit: str) -> dict[str, str]:
    out = lab.ssh(
        host, f"systemctl show {unit} -p MainPID,ActiveState,ExecMainStartTimestampMonotonic"
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _get(url: str, timeout: float = 5) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(1 << 20).decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return None, ""


def _complete(prompt: str) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    req = urllib.request.Request(
        f"{PROXY}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return str(json.loads(resp.read())["choices"][0]["text"])


def _in_rotation() -> bool | None:
    """The proxy's view of the engine: in rotation (True), ejected (False), no answer (None)."""
    code, text = _get(f"{PROXY}/metrics")
    if code != 200:
        return None
    for line in text.splitlines():
        if line.startswith("hgxserve_proxy_instance_healthy{") and ":8300" in line:
            return line.rsplit(" ", 1)[1].strip() in ("1", "1.0")
    return None


def _watch_state(lab: testbed_hosts.Testbed, host: str = "hgx-a") -> dict:
    out = lab.ssh(host, "curl -s --max-time 5 http://127.0.0.1:13346/state").stdout
    return json.loads(out) if out.strip() else {}


def _kill_and_recover(lab: testbed_hosts.Testbed, victim: str) -> dict:
    """SIGKILL `victim`'s engine main process; wait until the engine serves again as a whole.
    Returns what was seen: seconds to recover, whether the proxy ejected it, the head's PID."""
    head_before = _show(lab, "hgx-a", ENGINE_UNIT)
    worker_before = _show(lab, "hgx-b", ENGINE_UNIT)
    generation = _watch_state(lab)["generation"]
    pid = (head_before if victim == "hgx-a" else worker_before)["MainPID"]
    assert int(pid) > 0
    lab.ssh(victim, f"kill -9 {pid}", check=True)
    killed = time.monotonic()
    ejected = False
    while True:
        elapsed = time.monotonic() - killed
        assert elapsed < RECOVERY_BOUND_S, (
            f"not recovered in {RECOVERY_BOUND_S}s: {_watch_state(lab)}\n"
            + lab.ssh("hgx-a", f"journalctl -u {WATCH_UNIT} -n 30 --no-pager -o cat").stdout
        )
        if _in_rotation() is False:
            ejected = True
        state = _watch_state(lab)
        head = _show(lab, "hgx-a", ENGINE_UNIT)
        if (
            state.get("generation") == generation + 1
            and state.get("phase") == "watching"
            and head["ActiveState"] == "active"
            and _get(f"{ENGINE}/health")[0] == 200
        ):
            break
        time.sleep(0.5)
    recovered_s = time.monotonic() - killed
    worker = _show(lab, "hgx-b", ENGINE_UNIT)
    # the whole engine restarted: both main processes are new
    assert head["MainPID"] != head_before["MainPID"]
    assert worker["MainPID"] != worker_before["MainPID"]
    assert worker["ActiveState"] == "active"
    # the proxy readmits it (its health checks) and requests succeed through it again
    deadline = time.monotonic() + 30
    while _in_rotation() is not True:
        assert time.monotonic() < deadline, "the proxy did not readmit the engine"
        time.sleep(0.5)
    assert _complete("Only answer: BACK") == "BACK"
    print(f"\n{victim} killed: engine serving again after {recovered_s:.1f}s (ejected: {ejected})")
    return {"recovered_s": recovered_s, "ejected": ejected, "state": state}


def test_the_engine_spans_two_hosts_and_serves_through_the_proxy(
    lab: testbed_hosts.Testbed,
) -> None:
    head_unit = lab.ssh("hgx-a", f"systemctl cat {ENGINE_UNIT}", check=True).stdout
    assert "Restart=on-failure" not in head_unit and f"watcher ({WATCH_UNIT})" in head_unit
    worker_unit = lab.ssh("hgx-b", f"systemctl cat {ENGINE_UNIT}", check=True).stdout
    assert "--headless" in worker_unit and "Restart=on-failure" not in worker_unit
    for host in ("hgx-a", "hgx-b"):
        assert _show(lab, host, WATCH_UNIT)["ActiveState"] == "active"
    # the head served only once the worker joined it
    journal = lab.ssh("hgx-a", f"journalctl -u {ENGINE_UNIT} --no-pager -o cat").stdout
    assert "joined with 1 DP rank(s) (1/1)" in journal
    assert _watch_state(lab, "hgx-b")["role"] == "follower"
    assert _complete("Only answer: MULTI") == "MULTI"


def test_a_killed_worker_restarts_the_whole_engine(lab: testbed_hosts.Testbed) -> None:
    seen = _kill_and_recover(lab, "hgx-b")
    assert seen["ejected"], "the proxy never took the engine out of rotation"
    kinds = [e["kind"] for e in seen["state"]["events"]]
    assert kinds[-3:] == ["engine-down", "workers-restarted", "engine-recovered"]
    down = [e for e in seen["state"]["events"] if e["kind"] == "engine-down"][-1]
    assert "hgx-b" in down["down_hosts"] or "hgx-a" in down["down_hosts"]
    head_journal = lab.ssh("hgx-a", f"journalctl -u {ENGINE_UNIT} -n 400 --no-pager -o cat").stdout
    assert "EngineDeadError" in head_journal


def test_a_killed_head_restarts_the_whole_engine(lab: testbed_hosts.Testbed) -> None:
    seen = _kill_and_recover(lab, "hgx-a")
    assert seen["ejected"], "the proxy never took the engine out of rotation"
    down = [e for e in seen["state"]["events"] if e["kind"] == "engine-down"][-1]
    assert "hgx-a" in down["down_hosts"]
    worker_journal = lab.ssh(
        "hgx-b", f"journalctl -u {ENGINE_UNIT} -n 400 --no-pager -o cat"
    ).stdout
    assert "lost the head" in worker_journal  # it hung until the watcher restarted it


def test_status_tells_the_story(lab: testbed_hosts.Testbed) -> None:
    proc = subprocess.run(
        [HGXSERVE, "status", str(TOPOLOGY), "--inventory", "inventory/testhosts.py", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = json.loads(proc.stdout)
    text = json.dumps(report)
    assert '"restarts": 2' in text and "engine-recovered" in text, text[:3000]
    table = subprocess.run(
        [HGXSERVE, "status", str(TOPOLOGY), "--inventory", "inventory/testhosts.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    assert "2 restarts" in table and "hgx-a+hgx-b" in table, table
    print("\n" + table)
    logs = subprocess.run(
        [HGXSERVE, "logs", str(TOPOLOGY), "combined-0", "--inventory", "inventory/testhosts.py",
         "-n", "400"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout  # fmt: skip
    # the hosts' lines and the watchers' interleaved by time, each with its host
    hosts = [line.split(" | ", 1)[0].strip() for line in logs.splitlines() if " | " in line]
    assert {"hgx-a", "hgx-b"} <= set(hosts)
    switches = sum(a != b for a, b in zip(hosts, hosts[1:], strict=False))
    assert switches >= 2, "the hosts' lines are not interleaved"
    assert "engine-down" in logs and "restart-worker" in logs


def test_a_second_deploy_changes_nothing(lab: testbed_hosts.Testbed) -> None:
    pids = {h: _show(lab, h, u)["MainPID"] for h in ("hgx-a", "hgx-b") for u in (ENGINE_UNIT,)}
    proc = _deploy(lab)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text)
    assert match, text[-3000:]
    assert match.group(2, 3) == ("-", "-"), text[-3000:]  # no change, no error
    assert {h: _show(lab, h, ENGINE_UNIT)["MainPID"] for h in pids} == pids
    assert _watch_state(lab)["restarts"] == 2  # the deploy restarted nothing
