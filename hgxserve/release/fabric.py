"""Fabric preflight before a release that crosses hosts: what to measure, the commands that
measure it, and the verdict (pure; the pyinfra steps are hgxserve.operations.fabric).

A rail that is down, a missing RoCE GID or half bandwidth otherwise shows up as a 30-minute
health timeout or as KV silently moving over TCP. Before any unit changes, for a topology whose
P/D KV or engines cross hosts (`gate.fabric`, fail by default):

- links: every rail the hosts name (`hosts.<h>.rdma`): the port's sysfs state (ACTIVE), rate
  (at least the GPU kind's rail rate, `FABRIC_RAIL_GBPS`) and, on RoCE, a GID at
  `FABRIC_GID_INDEX`;
- bandwidth: perftest's `ib_write_bw --report_gbits` between the hosts of each P/D route whose
  KV crosses hosts (each prefill host -> each decode host) and of each engine placed on several
  hosts (its head -> each other host), on every rail both hosts name, rail i to rail i. The
  server runs on the second host, started by the controller in the background (bounded by
  `timeout`); the client on the first connects to the server host's topology address (perftest's
  out-of-band TCP exchange), so no host needs SSH to another. Its average must reach
  `FABRIC_BW_FLOOR` of the rail rate;
- all-reduce: nccl-tests' all_reduce_perf across each multi-host engine's hosts, one process
  per host, launched by mpirun from the engine's head where the inventory names one
  (`nccl_mpirun`): nccl-tests spans hosts only under MPI, whose launcher needs SSH between the
  hosts. Its bus bandwidth must reach `FABRIC_NCCL_FLOOR` of the slowest host's rails.

    >>> expected_rail_gbps("H200", 200.0), expected_rail_gbps("H100", 200.0)
    (400.0, 200.0)
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from hgxserve.base.defaults import (
    FABRIC_BW_FLOOR,
    FABRIC_GID_INDEX,
    FABRIC_NCCL_BYTES,
    FABRIC_NCCL_FLOOR,
    FABRIC_NCCL_TIMEOUT_S,
    FABRIC_PERFTEST_PORT,
    FABRIC_RAIL_GBPS,
    FABRIC_TOOL_TIMEOUT_S,
)
from hgxserve.base.paths import FABRIC_RUN_DIR
from hgxserve.parsers.fabric import (
    ZERO_GID,
    AllReduceReport,
    BwReport,
    PortReading,
    port_rate_gbps,
)
from hgxserve.topology import Topology

RECORD = "fabric.json"  # releases/<id>/fabric.json on each measured host


@dataclass(frozen=True)
class Pair:
    """ib_write_bw from `client` to `server` on each of `rails`, and why they talk."""

    client: str
    server: str
    rails: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Span:
    """An engine placed on several hosts: the NCCL all-reduce across them, from its head."""

    engine: str
    hosts: tuple[str, ...]  # placement order; the first is the head
    gpus: int  # the engine's GPUs on each host (the schema places whole DP ranks per host)
    rails: tuple[str, ...]  # the rails every one of its hosts names (NCCL_IB_HCA)


@dataclass(frozen=True)
class FabricScope:
    """What the preflight measures: each host's rails, the host pairs, the multi-host engines."""

    rails: dict[str, tuple[str, ...]]  # host -> rails it names (hosts.<h>.rdma)
    pairs: tuple[Pair, ...]
    gpus: dict[str, str]  # host -> GPU kind, for the rail rate expected
    spans: tuple[Span, ...] = ()

    def servers(self, host: str) -> list[tuple[int, str]]:
        """(port, rail) of each ib_write_bw server `host` runs: one per rail per pair."""
        return [(port, rail) for pair, port, rail in self.runs() if pair.server == host]

    def clients(self, host: str) -> list[tuple[Pair, int, str]]:
        """(pair, port, rail) of each ib_write_bw client `host` runs."""
        return [run for run in self.runs() if run[0].client == host]

    def runs(self) -> list[tuple[Pair, int, str]]:
        """Every measurement with its own TCP port (a server serves one client)."""
        out: list[tuple[Pair, int, str]] = []
        for pair in self.pairs:
            for rail in pair.rails:
                out.append((pair, FABRIC_PERFTEST_PORT + len(out), rail))
        return out


def _route_pairs(topo: Topology) -> list[tuple[str, str, str]]:
    """(client, server, why) for each P/D route whose KV crosses hosts."""
    out = []
    for route in topo.proxy.routes if topo.proxy else ():
        prefill = sorted({h for n in route.prefill for h in topo.engines[n].place})
        decode = sorted({h for n in route.decode for h in topo.engines[n].place})
        why = f"P/D {'+'.join(route.prefill)} -> {'+'.join(route.decode)}"
        out += [(p, d, why) for p in prefill for d in decode if p != d]
    return out


def _engine_pairs(topo: Topology) -> list[tuple[str, str, str]]:
    """(head, other host, why) for each engine placed on several hosts."""
    out = []
    for name in sorted(topo.engines):
        engine = topo.engines[name]
        out += [(engine.head, h, f"engine {name} spans hosts") for h in engine.hosts[1:]]
    return out


def fabric_scope(topo: Topology) -> FabricScope | None:
    """What to measure for `topo`; None with `gate.fabric: off`, when nothing crosses hosts, or
    when none of the hosts involved names a rail (`hosts.<h>.rdma`)."""
    if topo.gate.fabric == "off":
        return None
    pairs: dict[tuple[str, str], Pair] = {}
    for client, server, why in _route_pairs(topo) + _engine_pairs(topo):
        if (client, server) in pairs or (server, client) in pairs:
            continue
        first, second = topo.hosts[client].rdma, topo.hosts[server].rdma
        shared = tuple(r for r in first if r in second)
        pairs[(client, server)] = Pair(client, server, shared, why)
    hosts = sorted({h for key in pairs for h in key})
    rails = {h: topo.hosts[h].rdma for h in hosts}
    if not any(rails.values()):
        return None
    gpus = {h: topo.hosts[h].gpu for h in hosts}
    return FabricScope(rails, tuple(pairs.values()), gpus, _spans(topo))


def _spans(topo: Topology) -> tuple[Span, ...]:
    """Each engine placed on several hosts whose hosts share a rail."""
    out = []
    for name in sorted(topo.engines):
        engine = topo.engines[name]
        if not engine.is_multi_node:
            continue
        shared = [r for r in topo.hosts[engine.head].rdma]
        shared = [r for r in shared if all(r in topo.hosts[h].rdma for h in engine.hosts)]
        if shared:
            gpus = len(engine.place[engine.head])
            out.append(Span(name, tuple(engine.hosts), gpus, tuple(shared)))
    return tuple(out)


def expected_rail_gbps(gpu: str, port_rate: float | None) -> float | None:
    """A rail's expected line rate: the GPU kind's seed figure, else the port's own rate."""
    return FABRIC_RAIL_GBPS.get(gpu, port_rate)


# --- commands run on the hosts ------------------------------------------------------------------


def links_command(sysfs: str, rails: Iterable[str], gid_index: int = FABRIC_GID_INDEX) -> str:
    """Shell printing `<device> <port> <attribute> <value>` for every port of `rails` under
    `sysfs` (state, rate, link_layer, the GID at `gid_index`); each read bounded to 200 bytes."""
    root = shlex.quote(sysfs)
    devices = " ".join(shlex.quote(r) for r in rails)
    return (
        f'for d in {devices}; do for p in {root}/$d/ports/*; do [ -d "$p" ] || continue; '
        f"for a in state rate link_layer gids/{int(gid_index)}; do "
        'v=$(head -c 200 "$p/$a" 2>/dev/null | head -n 1); '
        'echo "$d ${p##*/} ${a%%s/*} $v"; done; done; done; true'
    )


def _perftest_args(rail: str, port: int, roce: bool) -> str:
    gid = f" -x {FABRIC_GID_INDEX}" if roce else ""
    return f"ib_write_bw -d {shlex.quote(rail)} -p {int(port)} -F --report_gbits{gid}"


def server_command(servers: list[tuple[int, str]], roce: dict[str, bool], runs: int) -> str:
    """Start one ib_write_bw server per (port, rail) in the background, each bounded by
    `timeout` (the clients of all `runs` measure one after another), its output under
    FABRIC_RUN_DIR."""
    bound = FABRIC_TOOL_TIMEOUT_S * (runs + 1)
    run_dir = shlex.quote(FABRIC_RUN_DIR)
    starts = [
        f"(setsid timeout {bound} {_perftest_args(rail, port, roce.get(rail, False))} "
        f"> {run_dir}/server-{int(port)}.log 2>&1 < /dev/null &)"
        for port, rail in servers
    ]
    return f"mkdir -p {run_dir} && " + "; ".join(starts)


def client_command(rail: str, port: int, address: str, roce: bool) -> str:
    """One ib_write_bw client run against `address` (retried while the server starts), its
    output followed by `##rc N`."""
    run = (
        f"timeout {FABRIC_TOOL_TIMEOUT_S} {_perftest_args(rail, port, roce)} {shlex.quote(address)}"
    )
    return (
        f"for i in 1 2 3; do out=$({run} 2>&1); rc=$?; [ $rc -eq 0 ] && break; sleep 1; done; "
        'printf "%s\\n" "$out"; echo "##rc $rc"'
    )


def allreduce_command(mpirun: str, span: Span, addresses: dict[str, str], roce: bool) -> str:
    """nccl-tests' all_reduce_perf across `span`'s hosts: one process per host with the
    engine's GPUs on it (`-g`), launched by `mpirun` (MPI is how nccl-tests spans hosts: it
    starts the other hosts' process over SSH between the hosts), NCCL on the span's rails;
    bounded by `timeout`; its output followed by `##rc N`."""
    hosts = ",".join(f"{addresses[h]}:1" for h in span.hosts)
    env = [f"NCCL_IB_HCA={','.join(span.rails)}"]
    if roce:
        env.append(f"NCCL_IB_GID_INDEX={FABRIC_GID_INDEX}")
    exports = " ".join(f"-x {shlex.quote(e)}" for e in env)
    return (
        f"timeout {FABRIC_NCCL_TIMEOUT_S} {shlex.quote(mpirun)} --allow-run-as-root "
        f"-np {len(span.hosts)} -H {shlex.quote(hosts)} {exports} all_reduce_perf "
        f"-b {FABRIC_NCCL_BYTES} -e {FABRIC_NCCL_BYTES} -g {int(span.gpus)} 2>&1; "
        'echo "##rc $?"'
    )


def allreduce_measurement(
    span: Span, report: AllReduceReport, host_gbps: dict[str, float | None], failure: str = ""
) -> dict[str, Any]:
    """One all-reduce for the record, with its shortfall (if any): `host_gbps` is each host's
    rails' expected rates summed (Gb/s); the bus bandwidth must reach FABRIC_NCCL_FLOOR of the
    slowest host's, in GB/s."""
    known = [g for g in host_gbps.values() if g]
    floor = round(FABRIC_NCCL_FLOOR * min(known) / 8, 2) if known else None
    out: dict[str, Any] = {
        "engine": span.engine,
        "hosts": list(span.hosts),
        "rails": list(span.rails),
        "gpus_per_host": span.gpus,
        "avg_busbw_gbytes": report.avg_busbw,
        "busbw_by_size": [list(row) for row in report.rows],
        "floor_gbytes": floor,
    }
    where = f"NCCL all-reduce of {span.engine} across {'+'.join(span.hosts)}"
    if report.avg_busbw is None:
        out["shortfall"] = f"{where} measured nothing: {failure or 'no Avg bus bandwidth line'}"
    elif report.out_of_bounds:
        out["shortfall"] = f"{where}: {report.out_of_bounds} out-of-bounds values (wrong results)"
    elif floor is not None and report.avg_busbw < floor:
        slowest = min(known)
        out["shortfall"] = (
            f"{where} (rails {','.join(span.rails)}): {report.avg_busbw:g} GB/s bus bandwidth, "
            f"below {floor:g} GB/s ({FABRIC_NCCL_FLOOR:g} x the slowest host's "
            f"{slowest:g} Gb/s of rails)"
        )
    return out


# --- the verdict --------------------------------------------------------------------------------


@dataclass
class FabricRun:
    """One run's preflight: the scope, the readings and measurements, the shortfalls."""

    scope: FabricScope
    policy: str
    links: dict[str, dict[str, PortReading]] = field(default_factory=dict)
    bandwidth: list[dict[str, Any]] = field(default_factory=list)
    allreduce: list[dict[str, Any]] = field(default_factory=list)
    shortfalls: list[str] = field(default_factory=list)
    judged: bool = False

    def roce(self, host: str) -> dict[str, bool]:
        """rail -> its port is RoCE (Ethernet link layer), as read on `host`."""
        return {
            reading.device: reading.link_layer.lower() == "ethernet"
            for reading in self.links.get(host, {}).values()
        }

    def judge(self) -> list[str]:
        """The shortfalls (once): link findings per host, then each measurement."""
        if not self.judged:
            for host in sorted(h for h, rails in self.scope.rails.items() if rails):
                self.shortfalls += link_findings(
                    host, self.scope.rails[host], self.links.get(host), self.scope.gpus[host]
                )
            measured = self.bandwidth + self.allreduce
            self.shortfalls += [m["shortfall"] for m in measured if m.get("shortfall")]
            self.judged = True
        return self.shortfalls

    def record(self, host: str) -> dict[str, Any]:
        """What `host` keeps in releases/<id>/fabric.json: its links, the measurements it
        took part in, and the run's verdict."""
        return {
            "policy": self.policy,
            "verdict": "short" if self.judge() else "pass",
            "shortfalls": self.shortfalls,
            "links": {k: asdict(v) for k, v in sorted(self.links.get(host, {}).items())},
            "bandwidth": [m for m in self.bandwidth if host in (m["client"], m["server"])],
            "allreduce": [m for m in self.allreduce if host in m["hosts"]],
        }


def _port_findings(host: str, reading: PortReading, gpu: str) -> list[str]:
    where = f"{host} rail {reading.device} port {reading.port}"
    if reading.state != "ACTIVE":
        return [f"{where} is {reading.state or 'unreadable'} (sysfs state), not ACTIVE"]
    out = []
    rate = port_rate_gbps(reading.rate)
    expect = expected_rail_gbps(gpu, rate)
    if rate is None or (expect is not None and rate < expect):
        out.append(
            f"{where} links at {reading.rate or 'an unreadable rate'}, below the {expect:g} "
            f"Gb/s a {gpu} host's rail runs at"
        )
    if reading.link_layer.lower() == "ethernet" and reading.gid in ("", ZERO_GID):
        out.append(
            f"{where} (RoCE) has no GID at index {FABRIC_GID_INDEX} "
            f"(read {reading.gid or 'nothing'}): the port has no IPv4 address for RoCE v2"
        )
    return out


def link_findings(
    host: str, rails: Iterable[str], readings: dict[str, PortReading] | None, gpu: str
) -> list[str]:
    """One line per rail of `host` that is missing, not ACTIVE, slow or without a RoCE GID."""
    if readings is None:
        return [f"{host}: its RDMA ports could not be read"]
    out = []
    for rail in rails:
        ports = [r for r in readings.values() if r.device == rail]
        if not ports:
            out.append(f"{host} rail {rail} has no port under the RDMA sysfs (no such device)")
        for reading in ports:
            out += _port_findings(host, reading, gpu)
    return out


def measurement(
    pair: Pair,
    rail: str,
    report: BwReport | None,
    rates: tuple[float | None, float | None],
    failure: str = "",
) -> dict[str, Any]:
    """One ib_write_bw measurement for the record, with its shortfall (if any): `rates` are the
    client's and server's expected rail rates."""
    known = [r for r in rates if r is not None]
    floor = round(FABRIC_BW_FLOOR * min(known), 2) if known else None  # Gb/s
    out: dict[str, Any] = {
        "client": pair.client,
        "server": pair.server,
        "rail": rail,
        "why": pair.why,
        "average_gbps": report.average_gbps if report else None,
        "peak_gbps": report.peak_gbps if report else None,
        "size": report.size if report else None,
        "iterations": report.iterations if report else None,
        "floor_gbps": floor,
    }
    where = f"ib_write_bw {pair.client} -> {pair.server} rail {rail}"
    if report is None:
        out["shortfall"] = f"{where} measured nothing: {failure or 'no result row'}"
    elif floor is not None and report.average_gbps < floor:
        out["shortfall"] = (
            f"{where}: {report.average_gbps:g} Gb/s average, below {floor:g} Gb/s "
            f"({FABRIC_BW_FLOOR:g} x the {min(known):g} Gb/s rail)"
        )
    return out
