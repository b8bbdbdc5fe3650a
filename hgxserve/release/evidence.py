"""RDMA evidence for P/D across hosts: the NIC port counters must grow while the gate runs.

HTTP 200, both engines busy and even NIXL's own transfer count are not proof that KV crossed the
hosts over RDMA: UCX falls back to TCP without failing (seed 003 §11.3: "RDMA hardware port
counters grow synchronously" was the last of the conditions; §11.4: prefill send and decode
receive grew on all four rails). The deploy reads `port_xmit_data` / `port_rcv_data` of every
RDMA port on the prefill and decode hosts before and after the gate; the prefill hosts must have
sent and the decode hosts received. The counters count 4-byte words (InfiniBand PortXmitData).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from hgxserve.paths import RDMA_SYSFS  # inventory host data `rdma_sysfs` overrides it
from hgxserve.topology import Topology

__all__ = ["RDMA_SYSFS", "counters_command", "parse_counters", "rdma_roles", "verdict"]
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


def rdma_roles(topo: Topology) -> dict[str, set[str]]:
    """Hosts whose RDMA counters are the gate's evidence, with what they must show: `sent` for
    prefill hosts, `received` for decode hosts, for every P/D route that crosses hosts."""
    roles: dict[str, set[str]] = {}
    if topo.proxy is None or topo.gate.rdma == "off":
        return roles
    for route in topo.proxy.routes:
        prefill_hosts = {h for n in route.prefill for h in topo.engines[n].place}
        decode_hosts = {h for n in route.decode for h in topo.engines[n].place}
        if prefill_hosts == decode_hosts and len(prefill_hosts) == 1:
            continue  # one host: KV goes over NVLink / CUDA IPC, not the NIC
        for host in prefill_hosts:
            roles.setdefault(host, set()).add(SENT)
        for host in decode_hosts:
            roles.setdefault(host, set()).add(RECEIVED)
    return roles


def verdict(
    roles: dict[str, set[str]],
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
