"""Parsing what the fabric preflight reads (hgxserve.parsers.fabric): perftest's ib_write_bw
report and the kernel's RDMA port attributes in sysfs."""

from __future__ import annotations

from hgxserve.parsers.fabric import (
    PortReading,
    parse_ib_write_bw,
    parse_port_lines,
    port_rate_gbps,
    port_state,
)

# ib_write_bw --report_gbits as perftest prints it (RESULT_LINE, RESULT_FMT_G, REPORT_FMT of
# linux-rdma/perftest src/perftest_parameters.h; the header block as ib_write_bw prints it)
REPORT = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : mlx5_0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : ON
 TX depth        : 128
 CQ Moderation   : 1
 Mtu             : 4096[B]
 Link type       : Ethernet
 GID index       : 3
 Max inline data : 0[B]
 rdma_cm QPs\t : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0091 PSN 0xc94686 RKey 0x17ffe1 VAddr 0x007f5fe8d09000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:11
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      5000             388.12             387.95  \t\t   0.739956
---------------------------------------------------------------------------------------
"""


def test_the_result_row_under_the_gbits_header() -> None:
    report = parse_ib_write_bw(REPORT.splitlines())
    assert report is not None
    assert (report.size, report.iterations) == (65536, 5000)
    assert (report.peak_gbps, report.average_gbps, report.msg_rate_mpps) == (
        388.12,
        387.95,
        0.739956,
    )


def test_no_row_when_the_run_failed_or_reported_megabytes() -> None:
    assert parse_ib_write_bw([" Port number 1 state is Down"]) is None
    assert parse_ib_write_bw(["Couldn't connect to 10.77.0.12:18515"]) is None
    megabytes = REPORT.replace("[Gb/sec]", "[MB/sec]")
    assert parse_ib_write_bw(megabytes.splitlines()) is None


def test_sysfs_port_state_and_rate() -> None:
    assert port_state("4: ACTIVE\n") == "ACTIVE"
    assert port_state("1: DOWN") == "DOWN" and port_state("") == ""
    assert port_rate_gbps("200 Gb/sec (4X HDR)") == 200.0
    assert port_rate_gbps("") is None and port_rate_gbps("fast") is None


def test_port_lines_become_readings() -> None:
    lines = [
        "mlx5_0 1 state 4: ACTIVE",
        "mlx5_0 1 rate 400 Gb/sec (4X NDR)",
        "mlx5_0 1 link_layer Ethernet",
        "mlx5_0 1 gid 0000:0000:0000:0000:0000:ffff:0a4d:000b",
        "mlx5_1 1 state",
        "noise",
    ]
    assert parse_port_lines(lines) == {
        "mlx5_0/1": PortReading(
            "mlx5_0",
            "1",
            "ACTIVE",
            "400 Gb/sec (4X NDR)",
            "Ethernet",
            "0000:0000:0000:0000:0000:ffff:0a4d:000b",
        ),
        "mlx5_1/1": PortReading("mlx5_1", "1", ""),
    }
