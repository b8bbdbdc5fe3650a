"""Who may reach which port: the host firewall's access plan, derived from the port plan.

Every listener hgxserve opens comes from hgxserve.topology.ports; this module says, for each one
on a host, which sources must reach it, and the renderer (hgxserve.render.firewall) turns that
into one nftables table. Filtered are the engines' listeners (HTTP API, VLLM_PORT, NIXL side
channels, the SGLang bootstrap server, the multi-node RPC/dist-init port and the watcher) and
the exporters; sshd, the proxy's own listener (the front door, with its own key) and the
Prometheus web port are never filtered, and nor is a listener bound to loopback.

Who reaches what:

- an engine's HTTP API: the proxy's host, the gate's host (it reads the engines' /metrics), the
  engine's P/D peers, the Prometheus host and the controller (its address as the hosts see it,
  which the deploy adds: not part of the release, so `hgxserve render` and status agree);
- a NIXL side channel, an SGLang bootstrap server: the P/D peers' hosts;
- a KV-event publisher and its replay listener: the proxy's host (it subscribes and replays);
- VLLM_PORT, the multi-node RPC/dist-init port, the watcher: the engine's own hosts;
- node/dcgm exporters: the Prometheus host;
- every filtered listener: the engine's own hosts and `firewall.allow`.

A host is named by its address and its side_channel_address (KV may leave from either).

>>> [a.listener.port for a in access_plan(topo, "h20-a")]  # doctest: +SKIP
[8100, 8200, 5600]
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from hgxserve.base.errors import HgxserveError
from hgxserve.topology.model import Topology, is_loopback
from hgxserve.topology.ports import KV_EVENTS, Listener, listeners_by_host, pd_peers

UNFILTERED_OWNERS = ("sshd", "proxy", "prometheus")
EXPORTERS = ("node-exporter", "dcgm-exporter")
HTTP_API = "HTTP API"
# listeners a P/D peer on another host dials (ports.py names them so)
PEER_REACHED = ("NIXL side channel", "SGLang bootstrap")
CONTROLLER = "controller"
ALLOW = "firewall.allow"


class FirewallError(HgxserveError):
    """An address the firewall would need is not an IP address or network."""


@dataclass(frozen=True)
class Source:
    """One source allowed on a port: an IP address or network, and why."""

    address: str
    why: str


@dataclass(frozen=True)
class Access:
    """One filtered listener and the sources allowed to reach it; everyone else is dropped."""

    listener: Listener
    sources: tuple[Source, ...]
    controller: bool = False  # the controller (its address as the host sees it) may reach it


# A zone after `%` (fe80::1%eth0) must be an interface name as Linux takes one (at most 15
# characters, no `/`, `:` or space) or a zone index. nftables matches no zone, so the source is
# the address itself, from any link.
ZONE = re.compile(r"\A(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}|[0-9]{1,10})\Z")
# The widest network one firewall.allow entry may name unless accepted: a /8 of IPv4 (16.7
# million addresses), a /32 of IPv6 (a regional registry's allocation to one network); an
# IPv4-mapped IPv6 network counts as the IPv4 network it maps.
MIN_PREFIX = {4: 8, 6: 32}


def ip_source(text: str, what: str) -> str:
    """`text` as one canonical IP address or network, else FirewallError.

    >>> ip_source("10.0.0.11", "x"), ip_source("10.0.0.0/24", "x"), ip_source("fd00::1", "x")
    ('10.0.0.11', '10.0.0.0/24', 'fd00::1')
    >>> ip_source("fe80::1%eth0", "x")
    'fe80::1'
    >>> ip_source("h20-a.lab", "host h20-a")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    hgxserve.topology.firewall.FirewallError: host h20-a: 'h20-a.lab' is not an IP address ...
    """
    address, pct, zone = text.partition("%")
    if pct and (not ZONE.match(zone) or "/" in address or ":" not in address):
        raise FirewallError(
            f"{what}: {text[:80]!r} is not an IP address or network: the text after % must "
            "be the interface name of an IPv6 address (fe80::1%eth0); nftables matches no "
            "interface there, so write the address alone"
        )
    try:
        network = ipaddress.ip_network(address, strict=False)
    except ValueError:
        raise FirewallError(
            f"{what}: {text[:80]!r} is not an IP address or network (the firewall names "
            "sources by address; write the host's IP address)"
        ) from None
    if network.num_addresses == 1:
        return str(network.network_address)
    return str(network)


def too_wide(text: str) -> str | None:
    """Why a firewall.allow entry opens too much (shorter than MIN_PREFIX), else None; the
    entry is a valid source (ip_source)."""
    network = ipaddress.ip_network(ip_source(text, ""), strict=False)
    version, prefix = network.version, network.prefixlen
    mapped = network.version == 6 and network.network_address.ipv4_mapped is not None
    if mapped and prefix >= 96:
        version, prefix = 4, prefix - 96
    if prefix >= MIN_PREFIX[version]:
        return None
    written = f"{network}:" if str(network) == text else f"{text[:80]!r} is {network}:"
    return (
        f"{written} it lets {network.num_addresses:.3g} addresses reach every port the "
        f"firewall filters; an IPv{version} entry may be no wider than /{MIN_PREFIX[version]}"
    )


def is_filtered(listener: Listener) -> bool:
    """True for a listener the firewall guards: an engine's or an exporter's, not on loopback."""
    return listener.owner not in UNFILTERED_OWNERS and not is_loopback(listener.bind)


def _engine_reachers(topo: Topology, listener: Listener) -> dict[str, str]:
    """Host name -> why, for an engine's listener."""
    engine = topo.engines[listener.owner]
    who = {h: "own host" for h in engine.hosts}
    peers = [topo.engines[n] for n in sorted(pd_peers(topo, engine)) if n in topo.engines]
    if listener.what.startswith(PEER_REACHED) or listener.what == HTTP_API:
        for peer in peers:
            for host in peer.place:
                who.setdefault(host, f"P/D peer {peer.name}")
    if listener.what.startswith(KV_EVENTS) and topo.proxy is not None:
        who.setdefault(topo.proxy.host, "proxy")
    if listener.what == HTTP_API:
        proxy = topo.proxy
        if proxy is not None:
            who.setdefault(proxy.host, "proxy")
            who.setdefault(topo.gate.from_host or proxy.host, "gate")
        if topo.monitoring is not None and topo.monitoring.prometheus_host:
            who.setdefault(topo.monitoring.prometheus_host, "Prometheus")
    return who


def reachers(topo: Topology, listener: Listener) -> dict[str, str]:
    """The topology's hosts that must reach `listener`, each with why."""
    if listener.owner in EXPORTERS:
        mon = topo.monitoring
        who = {listener.host: "own host"}
        if mon is not None and mon.prometheus_host:
            who.setdefault(mon.prometheus_host, "Prometheus")
        return who
    return _engine_reachers(topo, listener)


def _host_sources(topo: Topology, who: dict[str, str]) -> list[Source]:
    out: list[Source] = []
    for name, why in who.items():
        host = topo.hosts.get(name)
        if host is None:  # reported by host-known
            continue
        for address in dict.fromkeys((host.address, host.side_channel_address)):
            out.append(Source(ip_source(address, f"host {name}"), f"{name} ({why})"))
    return out


def access(topo: Topology, listener: Listener) -> Access:
    """Who may reach one filtered listener: hosts, `firewall.allow` and (HTTP API only) the
    controller; one entry per address, the first reason kept. The controller's address is
    not in the topology: the deploy reads it on each host (hgxserve.facts.host.ControllerAddress)
    and adds it to the table's controller sets."""
    sources = _host_sources(topo, reachers(topo, listener))
    sources += [Source(ip_source(a, ALLOW), ALLOW) for a in topo.firewall.allow]
    seen: dict[str, Source] = {}
    for source in sources:
        seen.setdefault(source.address, source)
    return Access(listener, tuple(seen.values()), controller=listener.what == HTTP_API)


def access_plan(topo: Topology, host: str) -> list[Access]:
    """Every filtered listener on `host` with its allowed sources, in the port plan's order;
    empty when the firewall is off."""
    if not topo.firewall.enabled:
        return []
    listeners = listeners_by_host(topo).get(host, [])
    return [access(topo, item) for item in listeners if is_filtered(item)]


def exposed(topo: Topology, keyed: set[str]) -> list[Listener]:
    """Listeners on a non-loopback address that nothing guards: the firewall is off and the
    listener has no key (only an engine's HTTP API can have one: the engines in `keyed`; vLLM
    checks it on /v1/* only, which the rule's message says)."""
    if topo.firewall.enabled:
        return []
    out = []
    for listeners in listeners_by_host(topo).values():
        for item in listeners:
            if not is_filtered(item):
                continue
            if item.what == HTTP_API and item.owner in keyed:
                continue
            out.append(item)
    return out


def firewall_plan(topo: Topology) -> dict[str, Any]:
    """What `hgxserve plan` shows of the firewall: on or off (and why), and per host in use
    each filtered port with who may reach it (an address it cannot express is an error)."""
    wall = topo.firewall
    out: dict[str, Any] = {"enabled": wall.enabled, "reason": wall.reason}
    out["allow"] = list(wall.allow)
    if not wall.enabled:
        return out
    hosts: dict[str, Any] = {}
    try:
        for name in topo.hosts_in_use():
            hosts[name] = [
                {
                    "port": item.listener.port,
                    "what": item.listener.label(),
                    "from": [{"address": s.address, "why": s.why} for s in item.sources],
                    "controller": item.controller,
                }
                for item in access_plan(topo, name)
            ]
    except FirewallError as exc:
        out["error"] = str(exc)
    out["hosts"] = hosts
    return out
