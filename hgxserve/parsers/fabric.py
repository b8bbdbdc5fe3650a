"""What the fabric preflight reads: perftest's `ib_write_bw --report_gbits` report and an RDMA
port's sysfs attributes (pure, no pyinfra).

ib_write_bw (linux-rdma/perftest) ends its run with a results table; with `--report_gbits` its
header is perftest_parameters.h's RESULT_FMT_G and each row REPORT_FMT
(`" %-7lu    %d           %-7.2lf            %-7.2lf\\t\\t   %-7.6lf"`):

    >>> report = parse_ib_write_bw([
    ...     " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]",
    ...     " 65536      5000             388.12             387.95   \\t\\t   0.739956",
    ... ])
    >>> report.average_gbps, report.peak_gbps, report.size
    (387.95, 388.12, 65536)

The kernel's sysfs (drivers/infiniband/core/sysfs.c) prints a port's state as `"%d: %s"` and its
rate as `"%d Gb/sec (%dX%s)"`:

    >>> port_state("4: ACTIVE"), port_state("1: DOWN")
    ('ACTIVE', 'DOWN')
    >>> port_rate_gbps("400 Gb/sec (4X NDR)"), port_rate_gbps("212.5 Gb/sec (4X HDR)")
    (400.0, 212.5)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

GBITS_HEADER = "BW average[Gb/sec]"
MBYTES_HEADER = "BW average[MB/sec]"
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass(frozen=True)
class BwReport:
    """One ib_write_bw result row: message size, iterations, peak and average Gb/s, Mpps."""

    size: int
    iterations: int
    peak_gbps: float
    average_gbps: float
    msg_rate_mpps: float


def parse_ib_write_bw(lines: Iterable[str]) -> BwReport | None:
    """The last result row under a `--report_gbits` header; None when the run printed none
    (it failed before measuring, or without `--report_gbits` the figures are MB/s)."""
    found: BwReport | None = None
    in_table = False
    for line in lines:
        if GBITS_HEADER in line:
            in_table = True
            continue
        if MBYTES_HEADER in line:
            in_table = False
            continue
        match = _ROW.match(line) if in_table else None
        if match:
            size, iters, peak, avg, rate = match.groups()
            found = BwReport(int(size), int(iters), float(peak), float(avg), float(rate))
    return found


def port_state(text: str) -> str:
    """`ACTIVE` from sysfs's `4: ACTIVE` (the name, upper case); `` for an empty read."""
    _, _, name = text.strip().partition(":")
    return (name or text).strip().upper()


def port_rate_gbps(text: str) -> float | None:
    """400.0 from sysfs's `400 Gb/sec (4X NDR)`; None when it reads otherwise."""
    match = _RATE.match(text)
    return float(match.group(1)) if match else None


@dataclass(frozen=True)
class PortReading:
    """One RDMA port's sysfs attributes as read (empty when the file could not be read)."""

    device: str
    port: str
    state: str = ""  # the state's name: ACTIVE, DOWN, ...
    rate: str = ""
    link_layer: str = ""
    gid: str = ""  # the GID at the index the preflight reads (RoCE: the IPv4 RoCE v2 entry)


def parse_port_lines(lines: Iterable[str]) -> dict[str, PortReading]:
    """{"mlx5_0/1": PortReading, ...} from `<device> <port> <attribute> <value...>` lines."""
    fields: dict[str, dict[str, str]] = {}
    for line in lines:
        parts = line.split(maxsplit=3)
        if len(parts) < 3 or parts[2] not in ("state", "rate", "link_layer", "gid"):
            continue
        values = fields.setdefault(f"{parts[0]}/{parts[1]}", {"device": parts[0], "port": parts[1]})
        value = parts[3].strip() if len(parts) == 4 else ""
        values[parts[2]] = port_state(value) if parts[2] == "state" else value
    return {key: PortReading(**values) for key, values in fields.items()}
