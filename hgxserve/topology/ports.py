"""Every TCP listener a topology opens, per host: the one place that knows the port scheme.

The rules (port clashes), `hgxserve plan`, the renderer and the proxy all ask this module which
port and address each listener uses, so the scheme is written once:

- engine HTTP API: `engine.port` on the engine's head host;
- VLLM_PORT (`internal_port`, vLLM): on every host of the engine;
- NIXL side channel (vLLM + nixl): `side_channel.port + dp_rank`, one per DP rank, on the host
  that runs that rank (vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`);
- SGLang disaggregation bootstrap (`kv.bootstrap_port`): on the prefill engine's head host,
  bound to the engine's `--host` like its HTTP API (SGLang's CommonKVBootstrapServer takes
  `server_args.host`), so an SGLang prefill with a decode on another host never binds loopback;
- KV-event publisher and replay listener (`kv_events.port`, `kv_events.replay_port`; default the
  engine's port + 20000 and + 21000): one of each per DP rank, `port + rank`, on the host that runs
  the rank, for every engine the hgxserve proxy routes with policy kv-events (vLLM's
  ZmqEventPublisher offsets both endpoints by the DP rank; SGLang's by the attention-DP rank, which
  is 0 for every replica without --enable-dp-attention);
- multi-node coordination (`rpc_port`): on the head of engines that span hosts;
- the watcher of an engine that spans hosts (`watch_port`): on each of its hosts;
- proxy: `proxy.listen` on the proxy host;
- sshd: `ssh.port` on every host (the deploy itself needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hgxserve.base.routing import reads_kv_events
from hgxserve.topology.model import Engine, RoutingPolicy, Topology, Warmup, is_loopback
from hgxserve.topology.problems import JsonPath

ANY_ADDRESS = "0.0.0.0"
# Default KV-event ports: the engine's port plus these (minus, where that would pass 65535). The
# offsets keep every engine's range clear of the ports hgxserve already uses (sshd, the engines'
# 8000-9999 and 30000 APIs, VLLM_PORT 20000/30000, side channels 5600, rpc/watch 13345/13346,
# exporters 9100/9400), and 1000 apart so a DP 8 engine's publishers never reach its replays.
KV_EVENTS_PORT_OFFSET = 20000
KV_EVENTS_REPLAY_OFFSET = 21000
KV_EVENTS = "KV events"
KV_EVENTS_REPLAY = "KV events replay"
LOCALHOST = "127.0.0.1"
UNSPECIFIED = (ANY_ADDRESS, "::")
MAX_PORT = 65535


@dataclass(frozen=True)
class Listener:
    """One listening socket: port, bind address, who owns it and what it is.

    >>> Listener(8100, "127.0.0.1", "prefill-0", "HTTP API").port
    8100
    """

    port: int
    bind: str
    owner: str  # engine name, "proxy" or "sshd"
    what: str
    host: str = ""
    path: JsonPath = ()  # where the topology sets this port (for error positions)

    def label(self) -> str:
        return f"{self.owner} {self.what}"


def setting_path(topo: Topology, engine: str, *keys: str) -> JsonPath:
    """JSON path where an engine setting is written: the engine itself, else `defaults`.

    Settings merged from `defaults` are reported where the user wrote them.

    >>> setting_path(topo, "decode-0", "args", "kv_cache_dtype")  # doctest: +SKIP
    ('defaults', 'args', 'kv_cache_dtype')
    """
    own: Any = topo.raw.get("engines", {}).get(engine, {})
    if _has(own, keys):
        return ("engines", engine, *keys)
    if _has(topo.raw.get("defaults", {}), keys):
        return ("defaults", *keys)
    # not written anywhere: point at the deepest part of the engine that exists
    for cut in range(len(keys) - 1, 0, -1):
        if _has(own, keys[:cut]):
            return ("engines", engine, *keys[:cut])
    return ("engines", engine)


def _has(data: Any, keys: tuple[str, ...]) -> bool:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def warmup_targets(topo: Topology, shape: Warmup) -> list[str]:
    """Engines a warm-up shape reaches: P/D routes for long prompts, combined ones otherwise."""
    proxy = topo.proxy
    if proxy is None:
        return list(topo.engines)
    pd_names = [n for r in proxy.routes for n in (*r.prefill, *r.decode)]
    if pd_names and (not proxy.combined or shape.input >= proxy.pd_min_prompt_tokens > 0):
        return pd_names
    return list(proxy.combined)


def proxy_targets(topo: Topology) -> set[str]:
    """Names of the engines the proxy sends requests to."""
    if topo.proxy is None:
        return set()
    names = set(topo.proxy.combined)
    for route in topo.proxy.routes:
        names.update(route.prefill)
        names.update(route.decode)
    return names


def pd_peers(topo: Topology, engine: Engine) -> set[str]:
    """Engines on the other side of this engine's proxy routes.

    Without proxy routes every prefill pairs with every decode (as the P/D rules assume).
    """
    out: set[str] = set()
    if topo.proxy is None or not topo.proxy.routes:
        other = {"prefill": "decode", "decode": "prefill"}.get(engine.role)
        return {e.name for e in topo.engines.values() if other and e.role == other}
    for route in topo.proxy.routes:
        if engine.name in route.prefill:
            out.update(route.decode)
        if engine.name in route.decode:
            out.update(route.prefill)
    return out


def kv_crosses_hosts(topo: Topology, engine: Engine) -> bool:
    """True when KV for this engine crosses hosts (multi-node, or a P/D peer elsewhere)."""
    hosts = set(engine.place)
    for name in pd_peers(topo, engine):
        other = topo.engines.get(name)
        if other is not None:
            hosts.update(other.place)
    return len(hosts) > 1


def binds_bootstrap(engine: Engine) -> bool:
    """True for an SGLang prefill with KV transfer: it serves the disaggregation bootstrap
    server, bound to its `--host` (the HTTP bind) as well."""
    return engine.engine == "sglang" and engine.kv is not None and engine.role == "prefill"


def bootstrap_dialers_elsewhere(topo: Topology, engine: Engine) -> list[str]:
    """Decodes that pull KV from this SGLang prefill and run (a rank) on a host other than its
    head: each dials the prefill's bootstrap server from there."""
    if not binds_bootstrap(engine):
        return []
    out = []
    for name in sorted(pd_peers(topo, engine)):
        other = topo.engines.get(name)
        if other is not None and other.role == "decode" and set(other.place) - {engine.head}:
            out.append(name)
    return out


def _proxy_beside(topo: Topology, engine: Engine) -> bool:
    """A proxy on the engine's host fronts it, and the engine runs on that host alone."""
    proxy = topo.proxy
    return proxy is not None and proxy.host == engine.head and not engine.is_multi_node


def bind_widened_for(topo: Topology, engine: Engine) -> list[str]:
    """The decodes on other hosts that made an unwritten bind 0.0.0.0 where the proxy beside the
    engine would have kept it on loopback (empty when they changed nothing)."""
    if engine.bind or not _proxy_beside(topo, engine):
        return []
    return bootstrap_dialers_elsewhere(topo, engine)


def engine_bind(topo: Topology, engine: Engine) -> str:
    """Address the engine's HTTP API binds to (and an SGLang prefill's bootstrap server).

    `bind` when given; else loopback when a proxy on the same host fronts a single-host engine
    that no peer on another host dials, else 0.0.0.0.
    """
    if engine.bind:
        return engine.bind
    if _proxy_beside(topo, engine) and not bootstrap_dialers_elsewhere(topo, engine):
        return LOCALHOST
    return ANY_ADDRESS


def bootstrap_address(topo: Topology, engine: Engine) -> str:
    """The address decodes dial for an SGLang prefill's bootstrap server (the `bootstrap_host`
    the proxy hands them): loopback for a loopback bind, else the host's address (a wildcard
    bind) or the bound address."""
    return reach_address(topo, engine.head, engine_bind(topo, engine), None)


def reach_address(topo: Topology, host: str, bind: str, from_host: str | None) -> str:
    """The address a client on `from_host` dials for a listener bound to `bind` on `host`
    (`from_host` None: a machine outside the topology, such as the controller).

    A wildcard bind (0.0.0.0, ::) is the host's address from elsewhere and loopback from the
    host itself; a specific address is that address; a loopback bind is loopback, which only
    the same host reaches (the `reachable` rule refuses topologies that need more).

    >>> reach_address(topo, "h20-a", "0.0.0.0", "h20-b")  # doctest: +SKIP
    '10.0.0.11'
    """
    if is_loopback(bind):
        return LOCALHOST if bind == "localhost" else bind
    if bind in UNSPECIFIED:
        if from_host == host:
            return LOCALHOST if bind == ANY_ADDRESS else "::1"
        known = topo.hosts.get(host)
        return known.address if known else host
    return bind


def _url(address: str, port: int) -> str:
    if ":" in address:
        address = f"[{address}]"
    return f"http://{address}:{port}"


def engine_url(topo: Topology, engine: Engine, *, from_host: str | None = None) -> str:
    """Base URL of the engine's OpenAI API as seen from `from_host` (default: the proxy host;
    "" for a machine outside the topology)."""
    if from_host is None:
        from_host = topo.proxy.host if topo.proxy else engine.head
    bind = engine_bind(topo, engine)
    return _url(reach_address(topo, engine.head, bind, from_host or None), engine.port)


def proxy_url(topo: Topology, from_host: str | None) -> str:
    """Base URL of the proxy as a client on `from_host` reaches it (None: a machine outside the
    topology, e.g. the controller running `hgxserve bench`); the one rule the release gate, the
    bench and Prometheus share.

    >>> proxy_url(topo, "h20-a"), proxy_url(topo, None)  # doctest: +SKIP
    ('http://127.0.0.1:8000', 'http://10.0.0.11:8000')
    """
    proxy = topo.proxy
    if proxy is None:
        raise ValueError(f"topology {topo.name} has no proxy")
    address = reach_address(topo, proxy.host, proxy.listen_host, from_host)
    return _url(address, proxy.listen_port)


def side_channel_host(topo: Topology, engine: Engine, host: str) -> str:
    """VLLM_NIXL_SIDE_CHANNEL_HOST for `engine`'s ranks on `host`.

    Omitted or 'auto': the host's `side_channel_address` (its routable address by default) when
    KV crosses hosts, loopback when prefill and decode share one host; otherwise as written.
    """
    written = engine.kv.side_channel_host if engine.kv else None
    if written in (None, "auto"):
        if kv_crosses_hosts(topo, engine) and host in topo.hosts:
            return topo.hosts[host].side_channel_address
        return LOCALHOST
    return written


def side_channel_ports(engine: Engine, host: str) -> list[tuple[int, int]]:
    """(dp_rank, port) of each NIXL side channel `engine` opens on `host`."""
    if not uses_nixl_side_channel(engine):
        return []
    assert engine.kv is not None
    base = engine.kv.side_channel_port
    return [(rank, base + rank) for rank in engine.dp_ranks_on(host)]


def uses_nixl_side_channel(engine: Engine) -> bool:
    return engine.engine == "vllm" and engine.kv is not None and engine.kv.connector == "nixl"


def engine_policies(topo: Topology, engine: Engine) -> set[RoutingPolicy]:
    """The routing policies of the proxy routes that reach `engine` (its P/D routes' policies,
    and the combined policy when it is a combined engine); empty when no proxy routes to it."""
    proxy = topo.proxy
    if proxy is None:
        return set()
    out: set[RoutingPolicy] = set()
    for route in proxy.routes:
        if engine.name in (*route.prefill, *route.decode):
            out.add(proxy.route_policy(route))
    if engine.name in proxy.combined:
        out.add(proxy.combined_route_policy)
    return out


def publishes_kv_events(topo: Topology, engine: Engine) -> bool:
    """True when `engine` publishes KV events: hgxserve's own proxy routes to it with a policy
    that reads them, kv-events (vllm-router and sglang-router never read them)."""
    proxy = topo.proxy
    return (
        proxy is not None
        and proxy.kind == "hgxserve"
        and engine.engine in ("vllm", "sglang")
        and any(reads_kv_events(policy) for policy in engine_policies(topo, engine))
    )


def _derived_port(base: int, offset: int, ranks: int) -> int:
    """`base + offset`, or `base - offset` where `ranks` ports from there would pass 65535."""
    return base + offset if base + offset + ranks - 1 <= MAX_PORT else base - offset


def kv_events_base_ports(engine: Engine) -> tuple[int, int]:
    """(publisher, replay) base ports: as written, else derived from the engine's port."""
    written = engine.kv_events
    port = written.port or _derived_port(engine.port, KV_EVENTS_PORT_OFFSET, engine.dp)
    replay = written.replay_port or _derived_port(engine.port, KV_EVENTS_REPLAY_OFFSET, engine.dp)
    return port, replay


def kv_event_ranks(engine: Engine, host: str) -> list[int]:
    """The port offsets of the KV-event publishers `engine` opens on `host`: its DP ranks there
    (vLLM, SGLang with DP attention); SGLang without DP attention publishes from each replica
    at offset 0, on the head (rule kv-events-sglang-dp refuses DP 2 or more)."""
    if engine.engine == "sglang" and not engine.dp_attention:
        return [0] if host == engine.head else []
    return list(engine.dp_ranks_on(host))


def kv_events_bind(topo: Topology, engine: Engine, host: str) -> str:
    """Address the replay listener binds on `host`: the HTTP API's bind on the head of a
    single-host engine (loopback beside the proxy), else every address. The publisher always
    binds every address: vLLM and SGLang bind a PUB endpoint only when it is a wildcard
    (`tcp://*:port`) and connect to any other, so the firewall is what guards it."""
    if host == engine.head and not engine.is_multi_node:
        return engine_bind(topo, engine)
    return ANY_ADDRESS


def kv_event_listeners(topo: Topology, engine: Engine, host: str) -> list[Listener]:
    """The publisher and replay listener of each DP rank of `engine` on `host` (none when the
    engine does not publish)."""
    if not publishes_kv_events(topo, engine):
        return []
    port, replay = kv_events_base_ports(engine)
    out = []
    for rank in kv_event_ranks(engine, host):
        out.append(
            Listener(
                port + rank,
                ANY_ADDRESS,
                engine.name,
                f"{KV_EVENTS} (dp rank {rank})",
                host,
                setting_path(topo, engine.name, "kv_events", "port"),
            )
        )
        out.append(
            Listener(
                replay + rank,
                kv_events_bind(topo, engine, host),
                engine.name,
                f"{KV_EVENTS_REPLAY} (dp rank {rank})",
                host,
                setting_path(topo, engine.name, "kv_events", "replay_port"),
            )
        )
    return out


def kv_event_endpoints(topo: Topology, engine: Engine) -> tuple[list[str], list[str]]:
    """(publisher, replay) ZMQ endpoints of every DP rank, in rank order, as the proxy's host
    dials them; empty when the engine does not publish."""
    if not publishes_kv_events(topo, engine):
        return [], []
    proxy = topo.proxy
    assert proxy is not None
    port, replay = kv_events_base_ports(engine)
    found: list[tuple[int, str, str]] = []
    for host in engine.hosts:
        for rank in kv_event_ranks(engine, host):
            pub = reach_address(topo, host, ANY_ADDRESS, proxy.host)
            rep = reach_address(topo, host, kv_events_bind(topo, engine, host), proxy.host)
            found.append((rank, _tcp(pub, port + rank), _tcp(rep, replay + rank)))
    found.sort()
    return [f[1] for f in found], [f[2] for f in found]


def _tcp(address: str, port: int) -> str:
    if ":" in address:
        address = f"[{address}]"
    return f"tcp://{address}:{port}"


def engine_listeners(topo: Topology, engine: Engine) -> list[Listener]:
    """Every listener of one engine, over all its hosts."""
    name = engine.name
    out: list[Listener] = [
        Listener(
            engine.port,
            engine_bind(topo, engine),
            name,
            "HTTP API",
            engine.head,
            setting_path(topo, name, "port"),
        )
    ]
    for host in engine.hosts:
        if host not in topo.hosts:  # reported by host-known
            continue
        if engine.engine == "vllm" and engine.internal_port is not None:
            out.append(
                Listener(
                    engine.internal_port,
                    ANY_ADDRESS,
                    name,
                    "VLLM_PORT",
                    host,
                    setting_path(topo, name, "internal_port"),
                )
            )
        for rank, port in side_channel_ports(engine, host):
            out.append(
                Listener(
                    port,
                    side_channel_host(topo, engine, host),
                    name,
                    f"NIXL side channel (dp rank {rank})",
                    host,
                    setting_path(topo, name, "kv", "side_channel", "port"),
                )
            )
        out += kv_event_listeners(topo, engine, host)
    if binds_bootstrap(engine):
        assert engine.kv is not None
        out.append(
            Listener(
                engine.kv.bootstrap_port,
                engine_bind(topo, engine),  # SGLang binds it to --host, as the HTTP API
                name,
                "SGLang bootstrap",
                engine.head,
                setting_path(topo, name, "kv", "bootstrap_port"),
            )
        )
    if engine.is_multi_node:
        what = "data-parallel RPC" if engine.engine == "vllm" else "dist-init"
        out.append(
            Listener(
                engine.rpc_port,
                ANY_ADDRESS,
                name,
                what,
                engine.head,
                setting_path(topo, name, "rpc_port"),
            )
        )
        for host in engine.hosts:
            if host in topo.hosts:
                out.append(
                    Listener(
                        engine.watch_port,
                        ANY_ADDRESS,
                        name,
                        "watcher",
                        host,
                        setting_path(topo, name, "watch_port"),
                    )
                )
    return out


def watch_url(topo: Topology, engine: Engine, host: str) -> str:
    """The watcher of a multi-node engine on `host` (its GET /state), as its peers reach it."""
    return _url(topo.hosts[host].address, engine.watch_port)


def listeners_by_host(topo: Topology) -> dict[str, list[Listener]]:
    """Every listener of the topology, grouped by host, in a stable order.

    Order per host: sshd, proxy, then engines in the order the topology defines them.

    >>> listeners_by_host(topo)["h20-a"][0]  # doctest: +SKIP
    Listener(port=22, bind='0.0.0.0', owner='sshd', what='ssh', host='h20-a', ...)
    """
    by_host: dict[str, list[Listener]] = {name: [] for name in topo.hosts}
    for name, host in topo.hosts.items():
        by_host[name].append(
            Listener(
                host.ssh_port, ANY_ADDRESS, "sshd", "ssh", name, ("hosts", name, "ssh", "port")
            )
        )
    proxy = topo.proxy
    if proxy is not None and proxy.host in by_host:
        by_host[proxy.host].append(
            Listener(
                proxy.listen_port,
                proxy.listen_host,
                "proxy",
                "OpenAI API",
                proxy.host,
                ("proxy", "listen"),
            )
        )
    for engine in topo.engines.values():
        for listener in engine_listeners(topo, engine):
            if listener.host in by_host:
                by_host[listener.host].append(listener)
    for listener in monitoring_listeners(topo):
        if listener.host in by_host:
            by_host[listener.host].append(listener)
    return by_host


def monitoring_listeners(topo: Topology) -> list[Listener]:
    """Exporters on every host in use and Prometheus on its host (when `monitoring:` asks)."""
    mon = topo.monitoring
    if mon is None:
        return []
    out: list[Listener] = []
    used = topo.hosts_in_use()
    engine_hosts = {h for e in topo.engines.values() for h in e.place}
    for host in used:
        if mon.node_exporter:
            out.append(
                Listener(
                    mon.node_exporter_port,
                    ANY_ADDRESS,
                    "node-exporter",
                    "metrics",
                    host,
                    ("monitoring", "node_exporter", "port"),
                )
            )
        if mon.dcgm_exporter and host in engine_hosts:
            out.append(
                Listener(
                    mon.dcgm_exporter_port,
                    ANY_ADDRESS,
                    "dcgm-exporter",
                    "metrics",
                    host,
                    ("monitoring", "dcgm_exporter", "port"),
                )
            )
    if mon.prometheus_host is not None:
        out.append(
            Listener(
                mon.prometheus_port,
                ANY_ADDRESS,
                "prometheus",
                "web",
                mon.prometheus_host,
                ("monitoring", "prometheus", "port"),
            )
        )
    return out
