"""KV transport evidence from the KV path itself: the transport UCX selected for the NIXL
endpoints of the P/D engines whose KV crosses hosts.

The hosts' RDMA port counters (`hgxserve.release.evidence`) count every byte of a NIC: in a
P/D topology with DP/EP engines their own all-to-all moves them too, so KV that fell back to
TCP would still see them grow (issue 26). UCX says which transport it picked: the engines of
such routes run with `UCX_PROTO_INFO=y` (hgxserve.render), so the first KV read or write on an
endpoint to another host logs a protocol-selection table naming the lanes, `rc_mlx5/mlx5_0:1`
for RDMA or `tcp/eth0` for the fallback (hgxserve.parsers.ucxproto). After the gate the deploy
reads those tables from the journal of each such engine's current run (its systemd invocation,
bounded), keeps what each unit's tables say in the release's record (`observed`: kv_transport,
kv_lanes), and fails the release when a KV endpoint to another host used TCP, or when nothing
showed an RDMA transport. The port counters stay checked, as supporting evidence.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hgxserve.parsers.sections import split_sections
from hgxserve.parsers.ucxproto import ProtoTable, parse_proto_info
from hgxserve.render.types import unit_name
from hgxserve.topology import Topology
from hgxserve.topology.kernels import deepep_across_hosts
from hgxserve.topology.model import UCX_RDMA_TLS

__all__ = [
    "KvEndpoint",
    "UnitRead",
    "JOURNAL_LINES",
    "JOURNAL_TIMEOUT_S",
    "journal_command",
    "kv_endpoints",
    "kv_only_rails",
    "parse_journal",
    "transport_verdict",
    "unit_record",
]

# Table lines kept per engine run: one table is 4-8 lines and UCX prints one per endpoint
# configuration and operation (a DP-16 decode with 2 rails: a few dozen tables).
JOURNAL_LINES = 4000
# Only bounds a journalctl that hangs (a damaged journal file, a stalled disk): a field match
# (_SYSTEMD_INVOCATION_ID=, INVOCATION_ID=) is looked up in the journal files' index.
JOURNAL_TIMEOUT_S = 30
TCP = "tcp"
RUN_START = "@run-start-in-journal"
HCA_VARS = ("NCCL_IB_HCA", "NVSHMEM_HCA_LIST")  # the HCAs an engine's own traffic may use


@dataclass(frozen=True)
class KvEndpoint:
    """An engine (on one of its hosts) whose NIXL endpoints carry KV to another host."""

    route: int
    engine: str
    role: str  # prefill | decode
    host: str
    peers: tuple[str, ...]  # the hosts of the route's other side

    @property
    def unit(self) -> str:
        return unit_name(self.engine)


def kv_endpoints(topo: Topology) -> list[KvEndpoint]:
    """The NIXL engines of every P/D route whose KV crosses hosts, one per engine host; none
    with `gate.rdma: off`."""
    if topo.gate.rdma == "off" or topo.proxy is None:
        return []
    out: list[KvEndpoint] = []
    for index, route in enumerate(topo.proxy.routes):
        sides = {"prefill": route.prefill, "decode": route.decode}
        hosts = {
            role: sorted({h for n in names for h in topo.engines[n].place})
            for role, names in sides.items()
        }
        if hosts["prefill"] == hosts["decode"] and len(hosts["prefill"]) == 1:
            continue  # one host: CUDA IPC, no NIC
        engines = [topo.engines[n] for names in sides.values() for n in names]
        if not all(e.kv is not None and e.kv.connector == "nixl" for e in engines):
            continue  # not UCX (SGLang's Mooncake): the port counters are the evidence
        for role, names in sides.items():
            other = tuple(hosts["decode" if role == "prefill" else "prefill"])
            for name in names:
                for host in sorted(topo.engines[name].place):
                    out.append(KvEndpoint(index, name, role, host, other))
    return out


def _hca_names(value: str) -> set[str] | None:
    """The devices an NCCL_IB_HCA / NVSHMEM_HCA_LIST value names (`mlx5_0,mlx5_1:1`, `=mlx5_0`);
    None for an exclusion list (`^mlx5_0`: every other device) or an empty value."""
    value = value.strip().lstrip("=")
    if not value or value.startswith("^"):
        return None
    return {item.strip().split(":")[0] for item in value.split(",") if item.strip()}


def kv_only_rails(topo: Topology, host: str) -> list[str] | None:
    """The RDMA devices on `host` that carry only KV, whose port counters are then the counter
    evidence instead of every port's; None when that cannot be told.

    They are the devices the host's cross-host NIXL engines name in `kv.ucx_devices` (a list,
    not `all`), when every engine on the host whose own traffic crosses hosts (a multi-node
    engine: TP/DP/EP over the NICs) names its HCAs, none of them a KV rail, in NCCL_IB_HCA and,
    when its DeepEP all-to-all crosses hosts, in NVSHMEM_HCA_LIST. An engine on one host keeps
    its own traffic on NVLink."""
    kv: set[str] = set()
    for ep in kv_endpoints(topo):
        if ep.host != host:
            continue
        spec = topo.engines[ep.engine].kv
        devices = spec.ucx_devices if spec is not None else None
        if not isinstance(devices, tuple):
            return None  # unset or `all`: UCX may use any device
        kv.update(d.split(":")[0] for d in devices)
    if not kv:
        return None
    deepep = set(deepep_across_hosts(topo, host))
    for engine in topo.engines_on(host):
        if not engine.is_multi_node:
            continue
        nccl, nvshmem = (_hca_names(engine.env.get(v, "")) for v in HCA_VARS)
        if nccl is None or nccl & kv or (nvshmem or set()) & kv:
            return None
        if engine.name in deepep and nvshmem is None:
            return None  # DeepEP's NVSHMEM uses every HCA unless told
    return sorted(kv)


@dataclass
class UnitRead:
    """What one engine unit's current run logged: its protocol-selection tables, and whether the
    journal still holds the run's start (else the tables, printed once at the first transfer,
    may have been rotated away)."""

    tables: list[ProtoTable]
    whole_run: bool


def journal_command(units: Iterable[str]) -> str:
    """Shell printing, per unit, `##<unit>`, RUN_START when the journal still holds the start
    of the unit's current run (systemd's own lines about it carry INVOCATION_ID), and the table
    lines the run logged (its output carries _SYSTEMD_INVOCATION_ID)."""
    parts = []
    for unit in units:
        q = shlex.quote(unit)
        journal = f"timeout {JOURNAL_TIMEOUT_S} journalctl -o cat --no-pager"
        parts.append(
            f"echo {shlex.quote('##' + unit)}; "
            f"id=$(systemctl show -p InvocationID --value {q}); "
            'if [ -n "$id" ]; then '
            f'{journal} -n 1 INVOCATION_ID="$id" | grep -q . && echo {RUN_START}; '
            f'{journal} _SYSTEMD_INVOCATION_ID="$id" | '
            f"grep -m {JOURNAL_LINES} -E '[|][[:space:]]*$'; fi"
        )
    return "; ".join(parts) + "; true"


def parse_journal(lines: list[str]) -> dict[str, UnitRead]:
    """{unit: what its current run logged} from journal_command's output."""
    return {
        unit: UnitRead(parse_proto_info(section["lines"]), RUN_START in section["lines"])
        for unit, section in split_sections(lines).items()
    }


def _kind(table: ProtoTable) -> str:
    """tcp: the KV went over TCP; rdma: over an RDMA transport; "" for neither."""
    if TCP in table.transports:
        return TCP
    return "rdma" if any(t in UCX_RDMA_TLS for t in table.transports) else ""


def _cross_host_kv(table: ProtoTable) -> bool:
    """A KV read/write to another host (`inter-node`, or an older UCX that does not say)."""
    return table.rma and table.locality in ("inter-node", "")


def unit_record(read: UnitRead) -> dict[str, Any]:
    """What a KV engine unit's UCX tables say, for the release's record (`observed`): the
    transport of its KV reads/writes to other hosts (`kv_transport`: rdma, tcp, or none when
    it logged none) and their lanes (`kv_lanes`, e.g. rc_mlx5/mlx5_0:1)."""
    tables = [t for t in read.tables if _cross_host_kv(t)]
    kinds = {_kind(t) for t in tables}
    transport = TCP if TCP in kinds else "rdma" if "rdma" in kinds else "none"
    lanes = list(dict.fromkeys(lane for t in tables for lane in t.lanes))
    return {"kv_transport": transport, "kv_lanes": lanes}


def _said(ep: KvEndpoint, table: ProtoTable) -> str:
    peer = "+".join(ep.peers)
    return (
        f"{ep.engine} on {ep.host} (KV {'to' if ep.role == 'prefill' else 'from'} {peer}): "
        f"{' and '.join(table.lanes)} for {table.operation} ({table.endpoint})"
    )


def kv_tables(
    endpoints: Sequence[KvEndpoint], read: dict[str, dict[str, UnitRead]]
) -> list[tuple[KvEndpoint, ProtoTable]]:
    """The tables of KV reads/writes to other hosts that each endpoint's engine logged."""
    out = []
    for ep in endpoints:
        unit = read.get(ep.host, {}).get(ep.unit)
        for table in unit.tables if unit is not None else []:
            if _cross_host_kv(table):
                out.append((ep, table))
    return out


def _rotated(
    endpoints: Sequence[KvEndpoint], read: dict[str, dict[str, UnitRead]]
) -> list[KvEndpoint]:
    """The endpoints whose engine's current run started before the journal's oldest entry."""
    out = []
    for ep in endpoints:
        unit = read.get(ep.host, {}).get(ep.unit)
        if unit is not None and not unit.whole_run:
            out.append(ep)
    return out


def _where(endpoints: Iterable[KvEndpoint]) -> str:
    return ", ".join(sorted({f"{ep.engine} on {ep.host}" for ep in endpoints}))


def transport_verdict(
    endpoints: Sequence[KvEndpoint], read: dict[str, dict[str, UnitRead]]
) -> tuple[bool, str]:
    """(passed, message): every cross-host route showed KV over RDMA and none over TCP. A route
    whose engines' runs began before the journal's oldest entry (not restarted for a long time:
    UCX printed their tables then, and the release that started them checked them) is said, not
    failed: the port counters are its only evidence here."""
    found = kv_tables(endpoints, read)
    tcp = [_said(ep, t) for ep, t in found if _kind(t) == TCP]
    if tcp:
        return False, (
            f"KV went over TCP, not RDMA: UCX selected {'; '.join(dict.fromkeys(tcp))} "
            "(check UCX_TLS / UCX_NET_DEVICES and that the KV NICs are up)"
        )
    rdma = [(ep, t) for ep, t in found if _kind(t) == "rdma"]
    unproven = {ep.route for ep in endpoints} - {ep.route for ep, _ in rdma}
    rotated = _rotated([ep for ep in endpoints if ep.route in unproven], read)
    missing = unproven - {ep.route for ep in rotated}
    if missing:
        return False, (
            "no UCX protocol-selection table of the KV endpoints "
            f"({_where(ep for ep in endpoints if ep.route in missing)}) names an RDMA transport: "
            "nothing shows the KV crossed the hosts over RDMA (UCX_PROTO_INFO=y prints one per "
            "endpoint; it needs UCX's protocol selection v2, UCX_PROTO_ENABLE)"
        )
    said = []
    if rdma:
        said.append(
            f"KV over RDMA: UCX selected {'; '.join(dict.fromkeys(_said(*f) for f in rdma))}"
        )
    if rotated:
        said.append(
            f"the UCX tables of {_where(rotated)} are no longer in the journal (their run "
            "started before its oldest entry)"
        )
    return True, "; ".join(said)
