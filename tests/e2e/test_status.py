"""`hgxserve status` and `hgxserve logs` end to end: the demo P/D release on the real test hosts,
read over real SSH with the test hosts' inventory; then one thing broken at a time.

The tests run in order: healthy, a pending switch, a stopped decode, a decode that fails with
a real captured error, an unreachable host.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import demo_lab, site

from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
HGXSERVE = str(REPO / ".venv/bin/hgxserve")
INVENTORY = "inventory/testhosts.py"
DECODE = "hgxserve-decode-0.service"
# a drop-in that makes the simulated decode fail at start the way a real one does on a host
# whose Fabric Manager is missing: it prints the real captured CUDA error 802 and exits 1
FAIL_DROPIN = f"/run/systemd/system/{DECODE}.d/simulated-failure.conf"


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with demo_lab(testbed, tmp_path_factory.mktemp("demo")) as bed:
        for topology in (
            BASELINE,
            PD,
        ):  # the baseline first: hgx-b then has a release to go back to
            proc = site(bed, topology)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        yield bed


def hgxserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HGXSERVE, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return hgxserve("status", str(PD), "--inventory", INVENTORY, *args)


def status_json() -> tuple[int, dict]:
    proc = status("--json")
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def wait_for(check, what: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def healthy() -> bool:
    return status().returncode == 0


def test_after_the_pd_deploy_status_is_healthy(lab: testbed_hosts.Testbed) -> None:
    wait_for(healthy, "a healthy status after the deploy", timeout=30)
    code, report = status_json()
    assert code == 0 and report["verdict"] == "healthy" and report["problems"] == []
    units = {
        unit["name"]: (host, unit)
        for host, view in report["hosts"].items()
        for unit in view["snapshot"]["units"]
    }
    assert set(units) == {
        "hgxserve-prefill-0.service",
        DECODE,
        "hgxserve-combined-0.service",
        "hgxserve-proxy.service",
    }
    for _, unit in units.values():
        assert (unit["active"], unit["health"]) == ("active", "ok"), unit
    # the GPUs each engine holds, read from the (simulated) nvidia-smi and the processes' units
    gpus = report["hosts"]["hgx-b"]["snapshot"]["gpus"]["gpus"]
    assert [g["processes"][0]["unit"] if g["processes"] else None for g in gpus] == [DECODE] * 4 + [
        None
    ] * 4
    assert all(g["memory_used_mib"] > 0 for g in gpus[:4])
    proxy = report["hosts"]["hgx-c"]["snapshot"]["proxy"]
    assert all(i["in_rotation"] for i in proxy["instances"]) and len(proxy["instances"]) == 3
    assert proxy["kv_handoffs"].get("ok", 0) >= 2  # the gate's two P/D completions
    decode = units[DECODE][1]
    assert decode["metrics"]["kv_transfers"] >= 2 and decode["metrics"]["kv_failed"] == 0
    weights = {h: v["snapshot"]["weights"] for h, v in report["hosts"].items()}
    assert all(w["marker"] and w["intact"] for w in weights.values())
    table = status().stdout
    assert table.startswith("demo-pd  HEALTHY  3/3 hosts")
    assert "PROXY hgx-c" in table and "PROBLEMS" not in table
    print(table)
    print(f"status on 3 hosts: {report['elapsed_s']:.2f} s")


def test_pending_release_shows_its_revert_deadline(lab: testbed_hosts.Testbed) -> None:
    state = json.loads(lab.ssh("hgx-b", "/opt/hgxserve/bin/hgxserve release status").stdout)
    running = state["current"]
    back = state["previous"]  # demo-baseline's release of hgx-b: no units
    assert back and back != running
    switched = lab.ssh(
        "hgx-b", f"/opt/hgxserve/bin/hgxserve release switch {back} --confirm-within 600"
    )
    assert switched.returncode == 0, switched.stderr
    try:
        started = time.time()
        code, report = status_json()
        assert code == 1
        pending = [p for p in report["problems"] if "pending" in p["message"]]
        assert len(pending) == 1 and pending[0]["host"] == "hgx-b"
        assert f"switch to {back} pending: reverts at" in pending[0]["message"]
        release = report["hosts"]["hgx-b"]["snapshot"]["release"]
        assert release["deadman"]["armed"] is True
        fires = release["deadman"]["fires_at"] or release["pending"]["deadline"]
        assert started + 540 < fires < started + 660  # 600 s from the switch
        table = status().stdout
        assert f"{back} pending" in table and "reverts " in table and "(in " in table
    finally:
        revert = f"/opt/hgxserve/bin/hgxserve release revert {back}"
        reverted = lab.ssh("hgx-b", revert, timeout=180)
        assert reverted.returncode == 0, reverted.stderr
    wait_for(healthy, "hgx-b back on the P/D release", timeout=60)


def test_stopped_decode_is_degraded_naming_host_unit_and_ejection(
    lab: testbed_hosts.Testbed,
) -> None:
    lab.ssh("hgx-b", f"systemctl stop {DECODE}", check=True)
    try:

        def ejected() -> bool:
            code, report = status_json()
            lines = [f"{p['host']}: {p['message']}" for p in report["problems"]]
            return code == 1 and any("proxy has decode-0" in line for line in lines)

        wait_for(ejected, "the proxy to eject the stopped decode", timeout=60)
        proc = status()
        assert proc.returncode == 1
        text = proc.stdout
        assert f"hgx-b: {DECODE} is inactive (dead)" in text
        assert "hgx-c: proxy has decode-0 (http://10.77.0.12:8200) out of rotation since" in text
        assert "connection refused" in text.lower()
        print(text)
    finally:
        lab.ssh("hgx-b", f"systemctl start {DECODE}", check=True)
    wait_for(healthy, "the decode back in rotation", timeout=60)


def test_logs_diagnose_names_a_simulated_engine_failure(lab: testbed_hosts.Testbed) -> None:
    dropin = (
        f"mkdir -p {Path(FAIL_DROPIN).parent} && printf '%s\\n' '[Service]' "
        "'Environment=HGXSERVE_SIM_FAIL=error:h200_error-802_hf-jobs' "
        f"'Environment=HGXSERVE_SIM_START_SECONDS=0' > {FAIL_DROPIN} && "
        f"systemctl daemon-reload && systemctl restart --no-block {DECODE}"
    )
    lab.ssh("hgx-b", dropin, check=True)
    try:
        wait_for(
            lambda: "Error 802" in lab.ssh("hgx-b", f"journalctl -u {DECODE} -n 50").stdout,
            "the simulated failure in the journal",
            timeout=120,
        )
        plain = hgxserve("logs", str(PD), "decode-0", "--inventory", INVENTORY, "-n", "30")
        assert plain.returncode == 0, plain.stderr
        assert all(line.startswith("hgx-b | ") for line in plain.stdout.splitlines())
        assert "Error 802: system not yet initialized" in plain.stdout
        proc = hgxserve("logs", str(PD), "decode-0", "--inventory", INVENTORY, "--diagnose")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"hgx-b: {DECODE}: cuda-802: CUDA error 802 (system not yet initialized)" in (
            proc.stdout
        )
        assert "Error 802: system not yet initialized" in proc.stdout
        print(proc.stdout)
        clean = hgxserve("logs", str(PD), "proxy", "--inventory", INVENTORY, "--diagnose")
        assert clean.returncode == 0 and "no known failure" in clean.stdout
    finally:
        lab.ssh(
            "hgx-b",
            f"rm -f {FAIL_DROPIN}; systemctl daemon-reload; systemctl reset-failed {DECODE}; "
            f"systemctl restart --no-block {DECODE}",
        )
    wait_for(healthy, "the decode healthy again", timeout=150)


def test_logs_follow_streams_every_host_until_interrupted(lab: testbed_hosts.Testbed) -> None:
    proc = subprocess.Popen(
        [HGXSERVE, "logs", str(PD), "prefill-0", "--inventory", INVENTORY, "-f", "-n", "5"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(5)
    assert proc.poll() is None, "-f keeps following"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) >= 5 and all(line.startswith("hgx-a | ") for line in lines), out


def test_unreachable_host_means_could_not_tell(lab: testbed_hosts.Testbed) -> None:
    veth = lab.host("hgx-a").veth
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        started = time.monotonic()
        proc = status("--connect-timeout", "2")
        elapsed = time.monotonic() - started
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "demo-pd  UNKNOWN  2/3 hosts" in proc.stdout
    assert "hgx-a  10.77.0.11  UNREACHABLE" in proc.stdout
    assert elapsed < 20  # bounded by the connect timeout, not by TCP's retries
    # the other hosts still answered: their units are listed
    assert "decode-0" in proc.stdout and "combined-0" in proc.stdout
