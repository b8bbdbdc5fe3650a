"""The host firewall end to end on real test hosts: the real pyinfra CLI, the nftables table
really loaded in each host's network namespace, the simulated engines behind it.

In order: the baseline (its engine listens on loopback only: no rules, no table), P/D over it
(demo-pd with the combined engine beside the proxy bound to 0.0.0.0, so that a port exists that
a test host must not reach; a table on every host: a host that is no peer of an engine times
out on its ports, the proxy's host and the P/D peers get through, the gate passes, the
controller still reads the engines),
a second run that changes nothing, the table back after a simulated boot and after a deploy
that finds it gone, and the rollback to the baseline that removes every table.
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import demo_lab, deploy, output

from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
PD = REPO / "topologies/demo/demo-pd.yml"
ADDRESS = {"hgx-a": "10.77.0.11", "hgx-b": "10.77.0.12", "hgx-c": "10.77.0.13"}
CONNECT_S = 4  # a dropped SYN is retried, never answered: the client gives up after this


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """demo-pd with combined-0 (beside the proxy on hgx-c) bound to every address: the proxy's
    host alone must reach it, hgx-a and hgx-b are no peers of it."""
    text = PD.read_text()
    old = "    port: 8300\n"
    assert text.count(old) == 1
    path = tmp_path_factory.mktemp("firewall") / "demo-pd-open.yml"
    path.write_text(text.replace(old, old + "    bind: 0.0.0.0\n"))
    return path


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    # a fresh start: no release, no firewall table
    with demo_lab(testbed, tmp_path_factory.mktemp("demo"), runtime=PD) as bed:
        yield bed


def tables(lab: testbed_hosts.Testbed, host: str) -> str:
    return lab.ssh(host, "nft list tables", check=True).stdout


def invocations(lab: testbed_hosts.Testbed, source: str, target: str, port: int) -> str:
    """A keyless POST /invocations from `source` to an engine on `target`: the HTTP status, or
    `timeout` when nothing answered (curl exit 28), or `refused` (exit 7)."""
    body = json.dumps({"model": "tiny", "prompt": "Only answer: FW_OK", "max_tokens": 4})
    proc = lab.ssh(
        source,
        f"curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout {CONNECT_S} --max-time 30 "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)} "
        f'http://{ADDRESS[target]}:{port}/invocations; echo " rc=$?"',
    )
    code, rc = proc.stdout.split()
    return {"rc=28": "timeout", "rc=7": "refused"}.get(rc, code)


def connects(lab: testbed_hosts.Testbed, source: str, target: str, port: int) -> str:
    """A bare TCP connect from `source` (a NIXL side channel is no HTTP): connected, refused
    or timeout."""
    proc = lab.ssh(
        source,
        f"timeout {CONNECT_S} bash -c 'exec 3<>/dev/tcp/{ADDRESS[target]}/{port}'; echo $?",
    )
    return {"0": "connected", "124": "timeout"}.get(proc.stdout.strip(), "refused")


def test_the_baseline_needs_no_table(lab: testbed_hosts.Testbed) -> None:
    proc = deploy(lab, "deploys/site.py", f"topology={BASELINE}", "stages=runtime,weights,engines")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "GATE-OK" in output(proc)
    # combined-0 listens on hgx-a's loopback behind the proxy beside it: nothing to filter
    assert all("hgxserve" not in tables(lab, host) for host in lab.names)


def test_pd_loads_a_table_on_every_host_and_drops_who_is_no_peer(
    lab: testbed_hosts.Testbed, pd: Path
) -> None:
    proc = deploy(lab, "deploys/engines.py", f"topology={pd}")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "GATE-OK" in output(proc)  # the gate on hgx-c reads every engine through the table
    for host in lab.names:
        assert "table inet hgxserve" in tables(lab, host)
    ruleset = lab.ssh("hgx-a", "nft list table inet hgxserve", check=True).stdout
    assert re.search(r"tcp dport 8100 ip saddr \{ 10\.77\.0\.1[1-3], .*\} accept", ruleset)
    assert "tcp dport 22" not in ruleset  # sshd is never matched
    # vLLM answers a keyless POST /invocations (its key guards /v1 only): only the firewall
    # keeps it from anyone on the network. hgx-a is neither proxy nor peer of combined-0.
    assert invocations(lab, "hgx-a", "hgx-c", 8300) == "timeout"
    assert invocations(lab, "hgx-b", "hgx-c", 8300) == "timeout"
    assert invocations(lab, "hgx-c", "hgx-c", 8300) == "200"  # the proxy's host (loopback path)
    assert invocations(lab, "hgx-c", "hgx-a", 8100) == "200"  # from the proxy's host
    assert invocations(lab, "hgx-b", "hgx-a", 8100) == "200"  # from the P/D peer
    # the NIXL side channel: the decode's host gets through, the proxy's host does not
    assert connects(lab, "hgx-b", "hgx-a", 5600) == "connected"
    assert connects(lab, "hgx-c", "hgx-a", 5600) == "timeout"
    # ports hgxserve does not own are not touched: sshd from every host
    assert connects(lab, "hgx-c", "hgx-a", 22) == "connected"
    # the controller (its address as the hosts see it) still reads the engines directly
    controller = lab.ssh("hgx-b", "cat /etc/hgxserve/firewall.d/controller.nft", check=True)
    assert "controller_v4 { 10.77.0.1 }" in controller.stdout
    with urllib.request.urlopen("http://10.77.0.12:8200/metrics", timeout=10) as resp:
        assert resp.status == 200


def test_a_second_run_changes_nothing(lab: testbed_hosts.Testbed, pd: Path) -> None:
    before = lab.ssh("hgx-a", "nft -a list table inet hgxserve", check=True).stdout
    proc = deploy(lab, "deploys/engines.py", f"topology={pd}")
    assert proc.returncode == 0, output(proc)[-4000:]
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(proc))
    assert match, output(proc)[-3000:]
    assert match.group(2, 3) == ("-", "-"), output(proc)[-3000:]
    # the same rule handles: the table was not loaded again
    assert lab.ssh("hgx-a", "nft -a list table inet hgxserve", check=True).stdout == before


def test_the_table_is_back_after_boot(lab: testbed_hosts.Testbed) -> None:
    # what a reboot leaves: no table; the boot-time reconcile loads it before any unit starts
    lab.ssh("hgx-b", "nft delete table inet hgxserve", check=True)
    assert connects(lab, "hgx-c", "hgx-b", 5600) == "connected"  # open while it is gone
    lab.ssh("hgx-b", "systemctl start hgxserve-release-reconcile.service", check=True, timeout=120)
    assert "table inet hgxserve" in tables(lab, "hgx-b")
    assert connects(lab, "hgx-c", "hgx-b", 5600) == "timeout"
    assert invocations(lab, "hgx-a", "hgx-b", 8200) == "200"  # the prefill's host, a peer


def test_a_deploy_loads_a_lost_table_again_and_restarts_nothing(
    lab: testbed_hosts.Testbed, pd: Path
) -> None:
    # an nftables service restart (`flush ruleset`) takes the table away between deploys
    pids = lab.ssh("hgx-a", "systemctl show -p MainPID --value hgxserve-prefill-0", check=True)
    lab.ssh("hgx-a", "nft delete table inet hgxserve", check=True)
    proc = deploy(lab, "deploys/engines.py", f"topology={pd}")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "Load the host firewall again" in output(proc)
    assert "table inet hgxserve" in tables(lab, "hgx-a")
    assert connects(lab, "hgx-c", "hgx-a", 5600) == "timeout"
    again = lab.ssh("hgx-a", "systemctl show -p MainPID --value hgxserve-prefill-0", check=True)
    assert again.stdout == pids.stdout


def test_rollback_to_a_topology_without_rules_removes_the_tables(
    lab: testbed_hosts.Testbed,
) -> None:
    proc = deploy(lab, "deploys/rollback.py", "to=previous")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "GATE-OK" in output(proc)
    for host in lab.names:
        assert "hgxserve" not in tables(lab, host), host
