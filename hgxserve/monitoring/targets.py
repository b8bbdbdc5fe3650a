"""Scrape targets of a topology: the proxy, every engine's API, each host's exporters.

Every target carries the labels the rules group by: `topology`, `release` (the topology digest
the hosts run, first 12 hex digits), `host`, and for engines `engine`, `role`
(prefill/decode/combined; `proxy` for the proxy), `backend` (vllm/sglang) and `gpus` (the GPU
indices on the head host).

>>> [t.job for t in scrape_targets(topo)]  # doctest: +SKIP
['hgxserve-proxy', 'hgxserve-engine', 'hgxserve-engine', 'hgxserve-node', 'hgxserve-dcgm']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hgxserve.topology.model import Monitoring, Topology, is_loopback
from hgxserve.topology.ports import ANY_ADDRESS, engine_bind, proxy_url

JOB_PROXY = "hgxserve-proxy"
JOB_ENGINE = "hgxserve-engine"
JOB_NODE = "hgxserve-node"
JOB_DCGM = "hgxserve-dcgm"
JOBS = (JOB_PROXY, JOB_ENGINE, JOB_NODE, JOB_DCGM)
# What a topology without `monitoring:` gets: the schema's defaults.
DEFAULT_MONITORING = Monitoring.parse({})


@dataclass(frozen=True)
class Target:
    job: str
    address: str  # host:port
    labels: dict[str, str] = field(default_factory=dict)


def monitoring_of(topo: Topology) -> Monitoring:
    return topo.monitoring or DEFAULT_MONITORING


def release_label(topo: Topology) -> str:
    return topo.digest[:12]


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _address(topo: Topology, host: str, bind: str, prometheus_host: str | None) -> str:
    """How Prometheus reaches a listener bound to `bind` on `host`."""
    if prometheus_host == host and (bind == ANY_ADDRESS or is_loopback(bind)):
        return "127.0.0.1"
    if bind not in (ANY_ADDRESS, "::") and not is_loopback(bind):
        return bind
    return topo.hosts[host].address


def unreachable_engines(topo: Topology) -> list[str]:
    """Engines bound to loopback on a host other than Prometheus' (it cannot scrape them)."""
    prom = monitoring_of(topo).prometheus_host
    return [
        e.name
        for e in topo.engines.values()
        if is_loopback(engine_bind(topo, e)) and e.head != prom
    ]


def scrape_targets(topo: Topology) -> list[Target]:
    """Every target, in a stable order: proxy, engines (topology order), node, DCGM."""
    mon = monitoring_of(topo)
    prom = mon.prometheus_host
    base = {"topology": topo.name, "release": release_label(topo)}
    out: list[Target] = []
    proxy = topo.proxy
    if proxy is not None and proxy.host in topo.hosts:
        labels = {**base, "host": proxy.host, "role": "proxy"}
        # host:port of the proxy's URL as Prometheus' host reaches it (the gate and bench's rule)
        out.append(Target(JOB_PROXY, urlsplit(proxy_url(topo, prom)).netloc, labels))
    for engine in topo.engines.values():
        if engine.head not in topo.hosts:
            continue
        addr = _address(topo, engine.head, engine_bind(topo, engine), prom)
        labels = {
            **base,
            "host": engine.head,
            "engine": engine.name,
            "role": engine.role,
            "backend": engine.engine,
            "gpus": ",".join(str(g) for g in engine.place[engine.head]),
        }
        out.append(Target(JOB_ENGINE, _hostport(addr, engine.port), labels))
    hosts = topo.hosts_in_use()
    if mon.node_exporter:
        for host in hosts:
            addr = _address(topo, host, ANY_ADDRESS, prom)
            labels = {**base, "host": host}
            out.append(Target(JOB_NODE, _hostport(addr, mon.node_exporter_port), labels))
    if mon.dcgm_exporter:
        for host in gpu_hosts(topo):
            addr = _address(topo, host, ANY_ADDRESS, prom)
            labels = {**base, "host": host}
            out.append(Target(JOB_DCGM, _hostport(addr, mon.dcgm_exporter_port), labels))
    return out


def gpu_hosts(topo: Topology) -> list[str]:
    """Hosts in use that run an engine (the ones a DCGM exporter watches)."""
    used = {h for e in topo.engines.values() for h in e.place}
    return [h for h in topo.hosts_in_use() if h in used]
