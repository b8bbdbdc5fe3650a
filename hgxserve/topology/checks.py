"""The topology rules (DESIGN.md "Validation rules"), registered with `@rule`."""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.model import Topology
from hgxserve.topology.rules import Finding, rule


@rule("host-known", "error", "Engines and the proxy only use hosts the topology defines.")
def host_known(topo: Topology) -> Iterator[Finding]:
    for engine in topo.engines.values():
        for host in engine.place:
            if host not in topo.hosts:
                known = ", ".join(topo.hosts)
                yield (
                    ("engines", engine.name, "place", host),
                    f"unknown host '{host}'; hosts are: {known}",
                )
    if topo.proxy and topo.proxy.host not in topo.hosts:
        yield (("proxy", "host"), f"unknown host '{topo.proxy.host}'")
