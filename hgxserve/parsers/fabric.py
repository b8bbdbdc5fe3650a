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


@dataclass(frozen=True)
class AllReduceReport:
    """nccl-tests' all_reduce_perf: each size's out-of-place and in-place bus bandwidth
    (GB/s), its `# Avg bus bandwidth` and `# Out of bounds values` lines."""

    rows: tuple[tuple[int, float, float], ...]  # (size B, busbw out-of-place, in-place)
    avg_busbw: float | None
    out_of_bounds: int | None


_NCCL_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([\d.eE+-]+)")
_NCCL_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")


def _nccl_row(line: str) -> tuple[int, float, float] | None:
    """A result row: size count type redop root, then time algbw busbw #wrong twice (nccl-tests
    common.cu's Reporter: `%12li  %12li  %8s  %6s  %6i` + `  %7s  %6.2f  %6.2f  %5li` x 2)."""
    fields = line.split()
    if len(fields) < 13 or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    try:
        return int(fields[0]), float(fields[7]), float(fields[11])
    except ValueError:
        return None


def parse_all_reduce_perf(lines: Iterable[str]) -> AllReduceReport:
    """The table and summary of all_reduce_perf's output (rank 0 prints it all):

    >>> report = parse_all_reduce_perf([
    ...     "   268435456      67108864     float     sum      -1   1711.2  156.87  294.13"
    ...     "      0   1702.5  157.67  295.63      0",
    ...     "# Out of bounds values : 0 OK",
    ...     "# Avg bus bandwidth    : 294.88 ",
    ... ])
    >>> report.avg_busbw, report.rows[0][1], report.out_of_bounds
    (294.88, 294.13, 0)
    """
    rows: list[tuple[int, float, float]] = []
    avg = oob = None
    for line in lines:
        if line.startswith("#"):
            avg_match, oob_match = _NCCL_AVG.match(line), _NCCL_OOB.match(line)
            avg = float(avg_match.group(1)) if avg_match else avg
            oob = int(oob_match.group(1)) if oob_match else oob
            continue
        row = _nccl_row(line)
        if row is not None:
            rows.append(row)
    return AllReduceReport(tuple(rows), avg, oob)
