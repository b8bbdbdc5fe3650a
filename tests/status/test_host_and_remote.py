"""The host side of `hgxserve status` (parsing systemctl, the proxy's /metrics, a release
store) and the controller side's inventory loading and log commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest

from hgxserve.cli.status import _since, log_hosts
from hgxserve.proxy.balancer import Pool
from hgxserve.proxy.config import parse_proxy_config
from hgxserve.proxy.kvroute import Router
from hgxserve.proxy.metrics import Metrics
from hgxserve.release.store import ReleaseSpec, Store, UnitSpec
from hgxserve.remote.inventory import InventoryError, load_inventory
from hgxserve.remote.ssh import quote_argv
from hgxserve.status import host as inspect
from hgxserve.status.journal import journal_argv
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]


def test_systemctl_show_blocks_become_unit_states() -> None:
    text = (
        "Id=hgxserve-decode-0.service\nActiveState=active\nSubState=running\nNRestarts=2\n"
        "ActiveEnterTimestamp=@1800000000\n\n"
        "Id=hgxserve-proxy.service\nActiveState=failed\nResult=exit-code\n"
        "StateChangeTimestamp=@1800000100\n"
    )
    shown = inspect.parse_show(text)
    assert shown["hgxserve-decode-0.service"]["NRestarts"] == "2"
    assert shown["hgxserve-proxy.service"]["Result"] == "exit-code"
    assert inspect._timestamp("@1800000000") == 1800000000.0
    assert inspect._timestamp("") is None and inspect._timestamp("n/a") is None


def test_proxy_metrics_round_trip_rotation_reasons_and_kv_handoffs() -> None:
    config = parse_proxy_config(
        {
            "listen": {"host": "127.0.0.1", "port": 8000},
            "served_model_name": "tiny",
            "protocol": "vllm-nixl",
            "pd_groups": [
                {
                    "name": "g0",
                    "prefill": [{"url": "http://10.0.0.1:8100"}],
                    "decode": [{"url": "http://10.0.0.2:8200"}],
                }
            ],
        }
    )
    pool = Pool(config)
    prefill, decode = pool.instances
    prefill.set_healthy(True)
    decode.set_healthy(False, 'request failed: prefill said "no" } twice\nthen died')
    decode.outstanding = 3
    metrics = Metrics()
    metrics.kv_handoff("ok")
    metrics.kv_handoff("ok")
    metrics.kv_handoff("none")
    metrics.upstream_error(decode, "connect")
    router = Router(config, pool)
    metrics.extra = router.render
    router.stats.decisions = {("pd", "length"): 5, ("pd-local", "cache-hit"): 2}
    parsed = inspect.parse_proxy_metrics(metrics.render(pool))
    assert parsed["known"] and parsed["kv_handoffs"] == {"none": 1, "ok": 2}
    assert parsed["decisions"] == {"pd-local/cache-hit": 2, "pd/length": 5}
    by_url = {i["url"]: i for i in parsed["instances"]}
    assert by_url["http://10.0.0.1:8100"]["in_rotation"] is True
    out = by_url["http://10.0.0.2:8200"]
    assert out["in_rotation"] is False and out["outstanding"] == 3
    assert out["reason"] == 'request failed: prefill said "no" } twice\nthen died'
    assert out["upstream_errors"] == 1 and out["since"] == pytest.approx(decode.since, abs=1e-3)


def test_release_part_and_drift_read_the_store(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "lib"))
    installed = tmp_path / "etc" / "hgxserve-combined-0.service"
    spec = ReleaseSpec(
        id="r1", topology="demo", topology_digest="d" * 64, baseline=False, host="hgx-a",
        units=[UnitSpec("hgxserve-combined-0.service", "engine", None, [0, 1])],
        files={str(installed): 0o644, str(tmp_path / "etc" / "gone.json"): 0o644},
    )  # fmt: skip
    tree = store.release_dir("r1") / "tree"
    for path in spec.files:
        (tree / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tree / path.lstrip("/")).write_text("[Unit]\n")
    (store.release_dir("r1") / "release.json").write_text(spec.to_json())
    store.set_link("current", "r1")
    store.set_pending({"id": "r1", "previous": None, "since": 1.0, "deadline": 301.0})
    installed.parent.mkdir(parents=True)
    installed.write_text("[Unit]\nDescription=edited by hand\n")
    release, loaded = inspect.release_part(store)
    assert loaded is not None and release["running"] == "r1" and release["topology"] == "demo"
    assert release["pending"]["deadline"] == 301.0 and "deadman" in release
    drift = inspect.drift_part(store, loaded, {"hgxserve-old-0.service": "active"})
    assert drift == {
        "modified": [str(installed)],
        "missing": [str(tmp_path / "etc" / "gone.json")],
        "stray_units": ["hgxserve-old-0.service"],
    }


def test_inventory_groups_host_data_and_group_data(tmp_path: Path) -> None:
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text("ssh_user = 'ops'\nssh_port = 2222\n")
    (tmp_path / "group_data" / "gpu.py").write_text("import os\nssh_port = 22\n")
    (tmp_path / "inv.py").write_text(
        "gpu = [('h-a', {'ssh_hostname': '10.0.0.1'}), 'h-b']\n"
        "other = (['h-c'], {'ssh_user': 'root'})\n_private = ['nope']\n"
    )
    inv = load_inventory(str(tmp_path / "inv.py"))
    assert sorted(inv.hosts) == ["h-a", "h-b", "h-c"]
    assert inv.hosts["h-a"].data == {"ssh_user": "ops", "ssh_port": 22, "ssh_hostname": "10.0.0.1"}
    assert inv.hosts["h-c"].data == {"ssh_user": "root", "ssh_port": 2222}
    with pytest.raises(InventoryError, match="no host.s. h-z"):
        inv.select(["h-a", "h-z"])
    (tmp_path / "bad.py").write_text("raise SystemExit('no test hosts recorded')\n")
    with pytest.raises(InventoryError, match="no test hosts recorded"):
        load_inventory(str(tmp_path / "bad.py"))


def test_the_lab_inventory_loads() -> None:
    inv = load_inventory(str(REPO / "inventory/lab.py"))
    assert inv.hosts["h200-a"].data["ssh_hostname"] == "10.0.1.11"


def test_logs_targets_hosts_and_quoting() -> None:
    topo: Any = load_topology(REPO / "topologies/h200-dsv32-2p1d.yml")
    multi = next(e for e in topo.engines.values() if e.is_multi_node)
    unit, hosts = log_hosts(topo, multi.name, None)
    assert unit == f"hgxserve-{multi.name}.service" and hosts == multi.hosts and len(hosts) > 1
    assert log_hosts(topo, multi.name, hosts[1])[1] == [hosts[1]]
    with pytest.raises(click.BadParameter, match="does not run on"):
        log_hosts(topo, multi.name, "elsewhere")
    with pytest.raises(click.BadParameter, match="is not an engine"):
        log_hosts(topo, "nope", None)
    assert log_hosts(topo, "proxy", None) == ("hgxserve-proxy.service", [topo.proxy.host])
    with pytest.raises(click.BadParameter):
        _since("1 min ago\n; rm -rf /")
    command = quote_argv(journal_argv(unit, None, "10 min ago; reboot", False))
    assert "--since '10 min ago; reboot'" in command


def test_inspect_json_on_a_bare_machine(tmp_path: Path) -> None:
    snap = inspect.snapshot(root=str(tmp_path), model_path=str(tmp_path), cache_keys=("k-1",))
    assert json.loads(json.dumps(snap))["release"]["running"] is None
    assert snap["units"] == [] and snap["weights"]["marker"] is None
    assert snap["caches"] == {"k-1": {"present": False, "restored": False, "baked": False}}


def _unreachable_lab(tmp_path: Path) -> Path:
    """An inventory of the demo's three hosts, every one at a port nothing answers on."""
    inventory = tmp_path / "inv.py"
    inventory.write_text(
        "lab = [(n, {'ssh_hostname': '127.0.0.1', 'ssh_port': 1}) "
        "for n in ('hgx-a', 'hgx-b', 'hgx-c')]\n"
    )
    return inventory


def test_status_and_logs_without_reachable_hosts_cannot_tell(tmp_path: Path) -> None:
    import subprocess
    import sys

    inventory = _unreachable_lab(tmp_path)
    exe = str(Path(sys.executable).with_name("hgxserve"))
    pd = str(REPO / "topologies/demo/demo-pd.yml")
    proc = subprocess.run(
        [exe, "status", pd, "-i", str(inventory)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "demo-pd  UNKNOWN  0/3 hosts" in proc.stdout
    assert "hgx-a  10.77.0.11  UNREACHABLE: connection refused (127.0.0.1:1)" in proc.stdout
    data = json.loads(
        subprocess.run(
            [exe, "status", pd, "-i", str(inventory), "--json"],
            capture_output=True, text=True, timeout=60,
        ).stdout
    )  # fmt: skip
    assert data["exit_code"] == 2 and {p["host"] for p in data["problems"]} == {
        "hgx-a", "hgx-b", "hgx-c"
    }  # fmt: skip
    logs = subprocess.run(
        [exe, "logs", pd, "decode-0", "-i", str(inventory)], capture_output=True, text=True
    )
    assert logs.returncode == 2 and "hgx-b | cannot read the journal" in logs.stderr
    missing = subprocess.run(
        [exe, "status", pd, "-i", str(tmp_path / "none.py")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no such inventory file" in missing.stderr


def test_watch_refreshes_until_interrupted(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    inventory = _unreachable_lab(tmp_path)
    exe = str(Path(sys.executable).with_name("hgxserve"))
    proc = subprocess.Popen(
        [exe, "status", str(REPO / "topologies/demo/demo-pd.yml"), "-i", str(inventory),
         "--watch", "--interval", "0.5"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 60
    while sum("demo-pd  UNKNOWN" in line for line in seen) < 2 and time.monotonic() < deadline:
        seen.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2  # the last verdict: could not tell
    out = "".join(seen) + out
    assert out.count("demo-pd  UNKNOWN") >= 2 and "(every 0.5 s; Ctrl-C to stop)" in out


def test_inspect_shows_each_unit_start_time_and_kv_capacity(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "lib"))
    spec = ReleaseSpec(
        id="r1", topology="demo", topology_digest="d" * 64, baseline=False, host="hgx-a",
        units=[UnitSpec("hgxserve-combined-0.service", "engine", None, [0, 1])], files={},
    )  # fmt: skip
    (store.release_dir("r1") / "tree").mkdir(parents=True)
    (store.release_dir("r1") / "release.json").write_text(spec.to_json())
    store.set_link("current", "r1")
    store.note_observed("r1", "hgxserve-combined-0.service", {"start_s": 7.5, "kv_tokens": 2048})
    snap = inspect.snapshot(root=str(store.root))
    assert snap["units"][0]["observed"] == {"start_s": 7.5, "kv_tokens": 2048}
    assert snap["release"]["observed"] == store.observed("r1")
