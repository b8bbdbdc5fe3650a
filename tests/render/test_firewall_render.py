"""The host firewall's ruleset as rendered from the port plan: who may reach which port for P/D,
multi-node and combined topologies, the opt-out, and values that must never reach the text
unchecked. The full files are golden renders too (tests/golden/<topology>/<host>/etc/hgxserve/
firewall.nft)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT, kv_demo_pd, topology

from hgxserve.base.defaults import FABRIC_PERFTEST_PORT
from hgxserve.base.paths import FIREWALL_FILE
from hgxserve.cli.topology import plan
from hgxserve.render import RenderError, render_host, render_topology
from hgxserve.render.firewall import controller_elements, nft_string, render_firewall
from hgxserve.topology import load_topology
from hgxserve.topology.firewall import FirewallError, ip_source
from hgxserve.topology.ports import listeners_by_host
from hgxserve.topology.problems import TopologyError


def accepts(text: str) -> dict[int, set[str]]:
    """port -> the source addresses its accept rules name (not the controller's sets)."""
    out: dict[int, set[str]] = {}
    for port, addresses in re.findall(r"tcp dport (\d+) ip6? saddr \{ ([^}]*) \} accept", text):
        out.setdefault(int(port), set()).update(a.strip() for a in addresses.split(","))
    return out


def dropped(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"^\t\ttcp dport (\d+) drop", text, re.M)]


def test_pd_prefill_port_reaches_its_peer_and_the_proxy_only() -> None:
    text = render_firewall(kv_demo_pd(), "hgx-a")
    assert text is not None
    # one transaction: declare, delete, define (a second load replaces the table as a whole)
    assert text.index("table inet hgxserve\ndelete table inet hgxserve\ntable inet hgxserve {") > 0
    assert accepts(text) == {
        8100: {"10.77.0.11", "10.77.0.12", "10.77.0.13"},  # own, decode-0's host, proxy/gate
        5600: {"10.77.0.11", "10.77.0.12"},  # the side channel: own host and the decode's only
        28100: {"10.77.0.11", "10.77.0.13"},  # KV events: own host and the proxy's
        29100: {"10.77.0.11", "10.77.0.13"},  # their replay listener, the same
    }
    assert dropped(text) == [8100, 5600, 28100, 29100]
    assert "tcp dport 28100 ip saddr @controller_v4" not in text
    assert "tcp dport 8100 ip saddr @controller_v4 accept" in text  # HTTP API only
    assert "tcp dport 5600 ip saddr @controller_v4" not in text
    assert 'iifname "lo" accept' in text and "policy accept;" in text
    assert "dport 22" not in text and "dport 8000" not in text  # sshd, the proxy: untouched


def test_the_proxy_host_with_only_loopback_engines_gets_no_table(tmp_path: Path) -> None:
    # combined-0 listens on loopback; with policy least-outstanding it publishes no KV events
    path = _variant(tmp_path, "")
    assert "    policy: least-outstanding" in path.read_text()  # demo-pd's own policy
    topo = load_topology(path)
    assert render_firewall(topo, "hgx-c") is None
    assert FIREWALL_FILE not in render_host(topo, "hgx-c").files
    assert FIREWALL_FILE in render_host(topo, "hgx-a").files


def test_a_kv_event_publisher_beside_the_proxy_is_filtered_to_its_host() -> None:
    # the engines bind a PUB endpoint only as a wildcard: the proxy dials it on loopback
    # (always accepted), every other host is dropped
    text = render_firewall(kv_demo_pd(), "hgx-c")
    assert text is not None
    assert accepts(text) == {28300: {"10.77.0.13"}}
    assert dropped(text) == [28300]  # the replay listener binds loopback like the API


def test_sglang_bootstrap_reaches_the_decode_only() -> None:
    text = render_firewall(topology("demo/demo-sglang-pd.yml"), "hgx-a")
    assert text is not None
    assert accepts(text)[8998] == {"10.77.0.11", "10.77.0.12"}
    assert "SGLang bootstrap" in text


def test_multi_node_rpc_and_watcher_reach_the_engine_hosts_only() -> None:
    topo = topology("demo/demo-multinode.yml")
    head, worker = render_firewall(topo, "hgx-a"), render_firewall(topo, "hgx-b")
    assert head is not None and worker is not None
    engine_hosts = {"10.77.0.11", "10.77.0.12"}
    assert accepts(head)[13345] == engine_hosts  # data-parallel RPC on the head
    assert accepts(head)[13346] == engine_hosts == accepts(worker)[13346]  # the watchers
    assert accepts(head)[8300] == engine_hosts | {"10.77.0.13"}  # + the proxy's host


def test_combined_single_host_filters_vllm_port_to_the_host_itself() -> None:
    text = render_firewall(topology("h20-v4flash-tp8.yml"), "h20-a")
    assert text is not None
    # VLLM_PORT and the KV-event publisher bind 0.0.0.0; the proxy is on the same host
    assert accepts(text) == {20000: {"10.0.0.11"}, 28100: {"10.0.0.11"}}


def test_every_filtered_port_comes_from_the_port_plan_and_no_fabric_port_is_dropped() -> None:
    for path in sorted((ROOT / "topologies").rglob("*.yml")):
        topo = load_topology(path)
        for host, rendered in render_topology(topo).items():
            text = rendered.files.get(FIREWALL_FILE)
            planned = {li.port for li in listeners_by_host(topo)[host]}
            drops = dropped(text.content) if text else []
            assert set(drops) <= planned - {topo.hosts[host].ssh_port}, (path.name, host)
            # the fabric preflight's ib_write_bw servers (18515 + i) are never matched
            assert not [p for p in drops if FABRIC_PERFTEST_PORT <= p < FABRIC_PERFTEST_PORT + 64]


def _variant(tmp_path: Path, extra: str) -> Path:
    text = (ROOT / "topologies/demo/demo-pd.yml").read_text() + extra
    path = tmp_path / "fw.yml"
    path.write_text(text)
    return path


def test_opt_out_renders_no_table_and_plan_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _variant(tmp_path, 'firewall: {enabled: false, reason: "isolated lab VLAN"}\n')
    topo = load_topology(path)
    assert all(FIREWALL_FILE not in r.files for r in render_topology(topo).values())
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(plan, [str(path)])
    assert "firewall OFF: isolated lab VLAN" in result.output, result.output
    assert "no key and no firewall" in result.output  # the exposed-listener warnings


def test_plan_shows_who_may_reach_which_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(plan, ["topologies/demo/demo-pd.yml"])
    assert result.exit_code == 0, result.output
    assert (
        "    5600   prefill-0 NIXL side channel (dp rank 0) <- hgx-a (own host) 10.77.0.11, "
        "hgx-b (P/D peer decode-0) 10.77.0.12"
    ) in result.output
    assert "the controller" in result.output and "  anyone else: dropped" in result.output


def test_allow_entries_are_canonical_addresses(tmp_path: Path) -> None:
    topo = load_topology(_variant(tmp_path, "firewall: {allow: [10.9.0.0/16, 'fd00::0:7']}\n"))
    text = render_firewall(topo, "hgx-b")
    assert text is not None
    assert "10.9.0.0/16" in accepts(text)[8200] and "ip6 saddr { fd00::7 }" in text


@pytest.mark.parametrize("bad", ["10.0.0.1 } accept", "10.0.0.1\nflush ruleset", "gpu-a.lab", ""])
def test_an_address_that_is_no_ip_never_reaches_the_ruleset(bad: str) -> None:
    with pytest.raises(FirewallError):
        ip_source(bad, "firewall.allow")
    with pytest.raises(FirewallError):
        controller_elements((bad,))


@pytest.mark.parametrize("bad", ['x" accept', "a\nb", "back\\slash", "x" * 121])
def test_comments_refuse_what_could_end_them(bad: str) -> None:
    with pytest.raises(RenderError):
        nft_string(bad)


def test_a_hostname_address_is_refused_by_the_rule_and_by_the_renderer(tmp_path: Path) -> None:
    text = (ROOT / "topologies/demo/demo-pd.yml").read_text()
    path = tmp_path / "named.yml"
    path.write_text(text.replace("address: 10.77.0.12", "address: hgx-b.lab"))
    with pytest.raises(TopologyError, match="firewall allows sources by IP address"):
        load_topology(path)
    # the renderer refuses it too, whatever reached it
    topo = topology("demo/demo-pd.yml")
    hosts = {**topo.hosts, "hgx-b": replace(topo.hosts["hgx-b"], address="hgx-b.lab")}
    with pytest.raises(RenderError, match="hgx-b.lab"):
        render_firewall(replace(topo, hosts=hosts), "hgx-a")


def test_controller_elements_split_by_family() -> None:
    text = controller_elements(("10.77.0.1", "fd00::1"))
    assert "add element inet hgxserve controller_v4 { 10.77.0.1 }" in text
    assert "add element inet hgxserve controller_v6 { fd00::1 }" in text
    assert controller_elements(()).count("add element") == 0
