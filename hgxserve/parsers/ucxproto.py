"""UCX's protocol-selection tables (`UCX_PROTO_INFO=y`): which transport each endpoint uses.

With `UCX_PROTO_INFO=y` UCX prints, the first time an endpoint configuration selects protocols
for an operation, one table (openucx/ucx src/ucp/proto/proto_debug.c,
`ucp_proto_select_elem_info`) to its log output, each line behind UCX's log prefix:

    [1737024667.122978] [node13:2783427:0]   +---------------------------+------------ ...
    [1737024667.122982] [node13:2783427:0]   | perftest inter-node cfg#0 | active message by ...
    [1737024667.122984] [node13:2783427:0]   +---------------------------+------------ ...
    [1737024667.122817] [node13:2783427:0]   |          0..2038 | short | rc_mlx5/mlx5_0:1 |

The header names the endpoint configuration (`<context> inter-node|intra-node|self cfg#N`; a
NIXL agent's context is `ucp_context_<n>`) and the operation (`remote memory read by ucp_get*`
for a KV pull); each row a message-size range, the protocol and the lanes as `<transport>/<device>`
(`rc_mlx5/mlx5_0:1`, `tcp/eth0`, or `50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_2:1`).
Older UCX printed the same table behind `proto_debug.c:406  UCX  INFO  `, with `mpi ep_cfg[3]`
as the endpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ProtoTable", "parse_proto_info"]

# `<transport>/<device>` in a row's lane column: rc_mlx5/mlx5_0:1, tcp/eth0, cuda_ipc/cuda
LANE = re.compile(r"(?<![\w/])([a-z][a-z0-9_]*)/([A-Za-z0-9_.\-]+(?::\d+)?)")
# the endpoint cell of a header: `<context> inter-node cfg#0`, `mpi ep_cfg[3]`
ENDPOINT = re.compile(r"cfg#\d+|ep_cfg\[\d+\]")
RMA_OPERATIONS = ("remote memory read", "remote memory write")


@dataclass
class ProtoTable:
    """One protocol-selection table: the endpoint configuration, the operation and its rows
    (size range, protocol, lanes)."""

    endpoint: str
    operation: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def locality(self) -> str:
        """inter-node, intra-node, self, or "" when the UCX version does not say."""
        words = self.endpoint.split()
        return next((w for w in ("inter-node", "intra-node", "self") if w in words), "")

    @property
    def rma(self) -> bool:
        """A one-sided read or write (how NIXL moves KV blocks), not a control message."""
        return self.operation.startswith(RMA_OPERATIONS)

    @property
    def lanes(self) -> list[str]:
        """Every `<transport>/<device>` the rows name, in order, once each."""
        out: list[str] = []
        for _, _, lanes in self.rows:
            for tl, dev in LANE.findall(lanes):
                if f"{tl}/{dev}" not in out:
                    out.append(f"{tl}/{dev}")
        return out

    @property
    def transports(self) -> list[str]:
        """The transport names of the lanes (rc_mlx5, tcp, ...), once each."""
        return list(dict.fromkeys(lane.split("/", 1)[0] for lane in self.lanes))


def _cells(line: str) -> list[str] | None:
    """The cells of a table line behind any log prefix, or None for any other line."""
    start = line.find("| ")
    text = line[start:].rstrip() if start >= 0 else ""
    if len(text) < 3 or not text.endswith("|"):
        return None
    return [cell.strip() for cell in text[1:-1].split(" | ")]


def parse_proto_info(lines: Iterable[str]) -> list[ProtoTable]:
    """The protocol-selection tables in log lines (other lines are skipped).

    >>> t = parse_proto_info([
    ...     "[1.2] [h:1:0]   | ucp_context_0 inter-node cfg#1 | remote memory read by ucp_get* |",
    ...     "[1.2] [h:1:0]   +------------+------+",
    ...     "[1.2] [h:1:0]   |     0..inf | zero-copy | rc_mlx5/mlx5_0:1 |"])[0]
    >>> t.locality, t.rma, t.lanes, t.transports
    ('inter-node', True, ['rc_mlx5/mlx5_0:1'], ['rc_mlx5'])
    """
    tables: list[ProtoTable] = []
    current: ProtoTable | None = None
    for line in lines:
        cells = _cells(line)
        if cells is None:
            continue
        if len(cells) == 2 and ENDPOINT.search(cells[0]):
            current = ProtoTable(endpoint=cells[0], operation=cells[1])
            tables.append(current)
        elif len(cells) == 3 and current is not None:
            current.rows.append((cells[0], cells[1], cells[2]))
    return tables
