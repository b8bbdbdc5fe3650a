"""RDMA evidence for P/D across hosts: the NIC port counters must grow while the gate runs.

HTTP 200, both engines busy and even NIXL's own transfer count are not proof that KV crossed the
hosts over RDMA: UCX falls back to TCP without failing (seed 003 §11.3: "RDMA hardware port
counters grow synchronously" was the last of the conditions; §11.4: prefill send and decode
receive grew on all four rails). The deploy reads `port_xmit_data` / `port_rcv_data` of every
RDMA port on the prefill and decode hosts before and after the gate; the prefill hosts must have
sent and the decode hosts received. The counters count 4-byte words (InfiniBand PortXmitData).

With `gate.rdma: off` nothing is checked, and the deploy says so: KV that crosses hosts with a
`kv.ucx_tls` naming no RDMA transport went over TCP (`unchecked_transport`), and is never
reported as RDMA.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Iterable, Mapping

from hgxserve.base.paths import RDMA_SYSFS  # inventory host data `rdma_sysfs` overrides it
from hgxserve.topology import Topology
from hgxserve.topology.model import Engine

__all__ = [
    "RDMA_SYSFS",
    "counters_command",
    "parse_counters",
    "rdma_roles",
    "unchecked_transport",
    "verdict",
]
SENT, RECEIVED = "port_xmit_data", "port_rcv_data"
WORD_BYTES = 4


def counters_command(root: str, devices: Iterable[str] = ()) -> str:
    """Shell printing `<device> <port> <counter> <value>` for every RDMA port under `root`."""
    names = [shlex.quote(d) for d in devices] or ["*"]
    globs = " ".join(
        f"{shlex.quote(root)}/{name}/ports/*/counters/{counter}"
        for name in names
        for counter in (SENT, RECEIVED)
    )
    return (
        f'for f in {globs}; do [ -r "$f" ] || continue; '
        'p="${f%/counters/*}"; d="${p%/ports/*}"; '
        'echo "${d##*/} ${p##*/} ${f##*/} $(cat "$f")"; done; true'
    )


def parse_counters(lines: Iterable[str]) -> dict[str, int]:
    """{"mlx5_0/1/port_xmit_data": value, ...} from counters_command's output."""
    out: dict[str, int] = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[3].isdigit():
            out[f"{parts[0]}/{parts[1]}/{parts[2]}"] = int(parts[3])
    return out


def grown(before: dict[str, int], after: dict[str, int], counter: str) -> int:
    """Bytes a counter grew by, summed over all ports."""
    words = sum(
        after[key] - before.get(key, after[key]) for key in after if key.endswith("/" + counter)
    )
    return words * WORD_BYTES


def _cross_host_routes(topo: Topology) -> list[tuple[list[str], list[str], list[Engine]]]:
    """(prefill hosts, decode hosts, engines) of every P/D route whose KV crosses hosts."""
    out = []
    for route in topo.proxy.routes if topo.proxy else ():
        prefill_hosts = sorted({h for n in route.prefill for h in topo.engines[n].place})
        decode_hosts = sorted({h for n in route.decode for h in topo.engines[n].place})
        if prefill_hosts == decode_hosts and len(prefill_hosts) == 1:
            continue  # one host: KV goes over NVLink / CUDA IPC, not the NIC
        engines = [topo.engines[n] for n in (*route.prefill, *route.decode)]
        out.append((prefill_hosts, decode_hosts, engines))
    return out


def rdma_roles(topo: Topology) -> dict[str, set[str]]:
    """Hosts whose RDMA counters are the gate's evidence, with what they must show: `sent` for
    prefill hosts, `received` for decode hosts, for every P/D route that crosses hosts."""
    roles: dict[str, set[str]] = {}
    if topo.gate.rdma == "off":
        return roles
    for prefill_hosts, decode_hosts, _ in _cross_host_routes(topo):
        for host in prefill_hosts:
            roles.setdefault(host, set()).add(SENT)
        for host in decode_hosts:
            roles.setdefault(host, set()).add(RECEIVED)
    return roles


def unchecked_transport(topo: Topology) -> str | None:
    """What carried cross-host P/D KV when the gate does not check RDMA counters (`gate.rdma:
    off`), in words for the gate and the deploy; None when they are checked or KV stays on one
    host. KV over NIXL whose engines' `kv.ucx_tls` names no RDMA transport went over TCP."""
    if topo.gate.rdma != "off":
        return None
    said = []
    for prefill_hosts, decode_hosts, engines in _cross_host_routes(topo):
        where = f"{'+'.join(prefill_hosts)} -> {'+'.join(decode_hosts)}"
        kvs = [e.kv for e in engines if e.kv is not None]
        tls = sorted({",".join(kv.ucx_tls) for kv in kvs if kv.ucx_tls is not None})
        if kvs and all(kv.ucx_tcp_only for kv in kvs):
            said.append(
                f"KV crossed hosts {where} over TCP (UCX_TLS={' / '.join(tls)} names no RDMA "
                "transport)"
            )
        else:
            said.append(f"KV crossed hosts {where} over a transport nothing checked")
    if not said:
        return None
    return "; ".join(said) + ": RDMA port counters not checked (gate.rdma: off)"


def verdict(
    roles: Mapping[str, Collection[str]],
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
    root: str,
) -> tuple[bool, str]:
    """(passed, message) for the counters read around the gate."""
    missing = sorted(h for h in roles if not after.get(h))
    if missing:
        return False, (
            f"no RDMA port counters under {root} on {', '.join(missing)}: P/D KV across hosts "
            "can only have gone over TCP (set gate.rdma: off for a lab without RDMA NICs)"
        )
    still: list[str] = []
    moved: list[str] = []
    for host in sorted(roles):
        for counter in sorted(roles[host]):
            delta = grown(before.get(host, {}), after[host], counter)
            what = "sent" if counter == SENT else "received"
            (moved if delta > 0 else still).append(f"{host} {what} {delta} B")
    if still:
        return False, (
            f"RDMA port counters did not move ({'; '.join(still)}) while the gate's P/D requests "
            "ran: KV went over a TCP fallback, not RDMA (check UCX_TLS / UCX_NET_DEVICES and "
            "that the NICs are up)"
        )
    return True, f"RDMA port counters grew: {'; '.join(moved)}"
