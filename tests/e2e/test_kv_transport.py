"""KV transport evidence end to end: P/D across two test hosts, the gate reads the transport UCX
selected for the decode's KV endpoint (the simulated engine prints UCX's protocol-selection
table, as a real one does with UCX_PROTO_INFO=y) and keeps the hosts' port counters as
supporting evidence. KV that falls back to TCP while the engines' other traffic still moves the
port counters is rolled back: the counters alone would have passed it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import demo_lab, deploy, links, output

from testbed import hosts as testbed_hosts
from testbed.simaccept import accept_simulation_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
# The engines' own DP/EP traffic over the same NICs, per generation request (simulated).
OTHER_TRAFFIC = "HGXSERVE_SIM_OTHER_RDMA_BYTES: 1048576"


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with demo_lab(testbed, tmp_path_factory.mktemp("demo")) as bed:
        yield bed


def current(lab: testbed_hosts.Testbed) -> dict[str, str]:
    return {host: links(lab, host)["current"] for host in lab.names}


def variant(tmp_path: Path, name: str, env: str) -> Path:
    """demo-pd whose prefill and decode engines run with `env` (a YAML mapping's items)."""
    text = PD.read_text()
    for port in ("8100", "8200"):
        text = text.replace(f"    port: {port}\n", f"    port: {port}\n    env: {{{env}}}\n")
    assert text.count("    env: {") == 2
    path = tmp_path / f"{name}.yml"
    path.write_text(accept_simulation_env(text.replace("name: demo-pd\n", f"name: {name}\n")))
    return path


def test_kv_over_rdma_passes_with_the_transport_named(lab: testbed_hosts.Testbed) -> None:
    proc = deploy(lab, "deploys/site.py", f"topology={PD}", "stages=runtime,weights,engines")
    text = output(proc)
    assert proc.returncode == 0, text[-4000:]
    # the decode's KV endpoint to hgx-a: UCX selected rc_mlx5 on the (simulated) NIC
    said = (
        r"KV over RDMA: UCX selected decode-0 on hgx-b \(KV from hgx-a\): rc_mlx5/mlx5_\d+:1 "
        r"for remote memory read by ucp_get\*\(multi\) into cuda/GPU0 \(ucp_context_0 "
        r"inter-node cfg#\d+\); RDMA port counters grew: hgx-a sent [1-9]\d* B; hgx-b received "
        r"[1-9]\d* B"
    )
    found = re.search(said, text)
    assert found, text[-4000:]
    print(found.group(0))
    # read from the decode's current run, whose start (systemd's INVOCATION_ID lines) the
    # journal still holds; the prefill only answers reads, so it logged no such table
    tables = "UCX protocol-selection tables of the KV engines' current run: "
    for unit, count in (("decode", 1), ("prefill", 0)):
        line = rf"{tables}hgxserve-{unit}-0\.service {count}(?![\d (])"
        assert re.search(line, text), text[-4000:]
    assert re.search(r"release \w+ confirmed", text)
    # ... and kept in the release's record on the decode's host (status --json shows it)
    status = json.loads(lab.ssh("hgx-b", "/opt/hgxserve/bin/hgxserve release status").stdout)
    kept = status["observed"]["hgxserve-decode-0.service"]
    assert kept["kv_transport"] == "rdma" and kept["kv_lanes"][0].startswith("rc_mlx5/mlx5_")
    # the table is in the decode's journal as UCX prints it
    journal = lab.ssh("hgx-b", "journalctl -u hgxserve-decode-0 -o cat --no-pager", check=True)
    assert re.search(r"\| +ucp_context_0 inter-node cfg#\d+ \| remote memory read", journal.stdout)
    # ... all of it from engines that ran as the unprivileged engine user
    pids = {}
    for host, unit in (("hgx-a", "hgxserve-prefill-0"), ("hgx-b", "hgxserve-decode-0")):
        pids[host] = engine_runs_unprivileged(lab, host, unit)
    # a second deploy: the user, its home and the units are converged, nothing restarts
    again = deploy(lab, "deploys/site.py", f"topology={PD}", "stages=runtime,weights,engines")
    assert again.returncode == 0, output(again)[-4000:]
    assert "Engine user hgxserve-engine" in output(again)
    totals = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(again))
    assert totals and totals.group(2, 3) == ("-", "-"), output(again)[-3000:]  # 0 changes
    for host, unit in (("hgx-a", "hgxserve-prefill-0"), ("hgx-b", "hgxserve-decode-0")):
        assert main_pid(lab, host, unit) == pids[host]  # same engines: nothing restarted


def main_pid(lab: testbed_hosts.Testbed, host: str, unit: str) -> int:
    proc = lab.ssh(host, f"systemctl show -p MainPID --value {unit}", check=True)
    return int(proc.stdout.strip())


def engine_runs_unprivileged(lab: testbed_hosts.Testbed, host: str, unit: str) -> int:
    """Every process of the engine unit runs as hgxserve-engine, with the unit's memlock limit
    and the user's home; its cache and run directories are the user's. Returns its MainPID."""
    pid = main_pid(lab, host, unit)
    assert pid > 0, f"{unit} on {host} has no main process"
    cgroup = lab.ssh(host, f"systemctl show -p ControlGroup --value {unit}", check=True)
    procs = lab.ssh(
        host,
        f'ps -o user:32= -p "$(paste -sd, /sys/fs/cgroup{cgroup.stdout.strip()}/cgroup.procs)"',
        check=True,
    )
    users = set(procs.stdout.split())
    print(f"{host} {unit}: MainPID {pid}, processes run as {sorted(users)}")
    assert users == {"hgxserve-engine"}, procs.stdout
    # LimitMEMLOCK=infinity, set by systemd before it drops to the user: as much as the host's
    # systemd may give (PID 1's hard limit; unlimited on a GPU host, where systemd holds
    # CAP_SYS_RESOURCE; a test host's nspawn container caps it at its own 8 MiB)
    memlock = "grep 'Max locked memory' /proc/{}/limits"
    limits = lab.ssh(host, memlock.format(pid), check=True).stdout.split()[3:5]
    ceiling = lab.ssh(host, memlock.format(1), check=True).stdout.split()[4]
    assert limits == [ceiling, ceiling], (limits, ceiling)
    environ = lab.ssh(host, f"tr '\\0' '\\n' < /proc/{pid}/environ", check=True).stdout
    assert "HOME=/var/lib/hgxserve/engine-home" in environ.splitlines()
    cache = re.search(r"^VLLM_CACHE_ROOT=(\S+)/vllm$", environ, re.M)
    tmp = re.search(r"^TMPDIR=(\S+)/tmp$", environ, re.M)
    assert cache and tmp, environ
    owners = lab.ssh(
        host,
        f"stat -c %U {cache.group(1)} {cache.group(1)}/vllm {tmp.group(1)} {tmp.group(1)}/tmp "
        "/var/lib/hgxserve/engine-home",
        check=True,
    )
    assert set(owners.stdout.split()) == {"hgxserve-engine"}, owners.stdout
    # a system user with no login shell; in `video` where the host has that group
    entry = lab.ssh(host, "getent passwd hgxserve-engine", check=True).stdout.strip().split(":")
    assert int(entry[2]) < 1000 and entry[5:] == [
        "/var/lib/hgxserve/engine-home",
        "/usr/sbin/nologin",
    ], entry
    has_video = lab.ssh(host, "getent group video").returncode == 0
    groups = lab.ssh(host, "id -nG hgxserve-engine", check=True).stdout.split()
    assert ("video" in groups) == has_video, groups
    return pid


def test_kv_falling_back_to_tcp_is_rolled_back_though_the_counters_moved(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = current(lab)
    tcp = variant(tmp_path, "demo-pd-kv-tcp", f"HGXSERVE_SIM_KV_TRANSPORT: tcp, {OTHER_TRAFFIC}")
    proc = deploy(lab, "deploys/engines.py", f"topology={tcp}")
    text = output(proc)
    assert proc.returncode != 0, text[-4000:]
    assert "decode pulled KV over NIXL" in text  # NIXL itself was fine, the answers right
    assert re.search(
        r"gate failed: KV went over TCP, not RDMA: UCX selected decode-0 on hgx-b "
        r"\(KV from hgx-a\): tcp/\S+ for remote memory read by ucp_get\*",
        text,
    ), text[-4000:]
    # the host-wide counters grew all the same (the engines' other traffic): alone they passed
    counters = r"RDMA port counters grew: hgx-a sent [1-9]\d* B; hgx-b received [1-9]\d* B \(supp"
    assert re.search(counters, text), text[-4000:]
    print(re.search(r"gate failed: KV went over TCP.*", text).group(0))  # type: ignore[union-attr]
    assert "rolled back to the previous release" in text
    assert current(lab) == before
    # the record of the release that failed, kept on the decode's host, says what UCX selected
    records = lab.ssh(
        "hgx-b",
        "python3 -c 'import glob, json; print(json.dumps([json.load(open(p)) for p in "
        'glob.glob("/var/lib/hgxserve/releases/*/observed.json")]))\'',
        check=True,
    )
    kept = [r.get("hgxserve-decode-0.service", {}) for r in json.loads(records.stdout)]
    tcp_kept = [r for r in kept if r.get("kv_transport") == "tcp"]
    assert tcp_kept and tcp_kept[0]["kv_lanes"] == ["tcp/eth0"], kept  # the host's eth0
