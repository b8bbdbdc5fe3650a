"""How the bench reaches the proxy and the engines: directly, or through SSH tunnels.

With an inventory every engine's /metrics is read through its own host (an engine the proxy
fronts listens on that host's loopback only), and `--from HOST` sends the load through HOST:
the connections to the proxy start on HOST, on the hosts' (client) network, as seed 003
measured "from another node"; the load generator itself stays on the controller (docs/bench.md
says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hgxserve.base.errors import UsageError
from hgxserve.remote.tunnel import Tunnels
from hgxserve.topology import Topology, ports
from hgxserve.topology.ports import engine_url


@dataclass
class Reach:
    proxy_url: str | None
    engine_urls: dict[str, str]
    origin: str  # where the connections to the proxy start, for run.json
    tunnels: Tunnels | None = None
    via: dict[str, str] = field(default_factory=dict)  # endpoint -> host it is reached through

    def close(self) -> None:
        if self.tunnels is not None:
            self.tunnels.close()


def _through(tunnels: Tunnels, host: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise UsageError(f"cannot tunnel to {url!r}: no host and port")
    return tunnels.url(host, parts.hostname, parts.port)


def open_reach(
    topo: Topology,
    *,
    inventory: str | None,
    from_host: str | None,
    proxy_url: str | None,
    engine_urls: dict[str, str],
) -> Reach:
    """The URLs the bench uses; tunnels opened when an inventory is given."""
    if inventory is None:
        if from_host is not None:
            raise UsageError("--from HOST needs --inventory (how to reach HOST over SSH)")
        return Reach(proxy_url, dict(engine_urls), "controller")
    from hgxserve.remote.inventory import InventoryError, load_inventory

    if topo.proxy is None:
        raise UsageError(f"{topo.source_file}: the topology has no proxy to bench through")
    if from_host is not None and proxy_url is not None:
        raise UsageError("give --from HOST or --proxy-url, not both")
    names = [e.head for e in topo.engines.values() if e.name not in engine_urls]
    names += [from_host] if from_host else []
    try:
        hosts = load_inventory(inventory).select(dict.fromkeys(names))
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    tunnels = Tunnels(hosts)
    reach = Reach(proxy_url, dict(engine_urls), "controller", tunnels)
    try:
        for engine in topo.engines.values():
            if engine.name in engine_urls:
                continue
            own = engine_url(topo, engine, from_host=engine.head)
            reach.engine_urls[engine.name] = _through(tunnels, engine.head, own)
            reach.via[engine.name] = f"{own} on {engine.head}"
        if from_host is not None:
            target = ports.proxy_url(topo, from_host)
            reach.proxy_url = _through(tunnels, from_host, target)
            reach.origin = f"{from_host} (SSH tunnel from the controller to {target})"
            reach.via["proxy"] = f"{target} from {from_host}"
    except BaseException:
        reach.close()
        raise
    return reach
