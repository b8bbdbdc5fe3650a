"""Parsing what the fabric preflight reads (hgxserve.parsers.fabric): perftest's ib_write_bw
report and the kernel's RDMA port attributes in sysfs."""

from __future__ import annotations

from hgxserve.parsers.fabric import (
    PortReading,
    parse_all_reduce_perf,
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


# all_reduce_perf as nccl-tests prints it (src/common.cu: the Reporter's header and row
# formats, `# Out of bounds values`, `# Avg bus bandwidth`), two processes of 8 GPUs
ALL_REDUCE = """\
# nThread 1 nGpus 8 minBytes 268435456 maxBytes 268435456 step: 1048576(bytes) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   6899 on      hgx-b device  0 [0x18] NVIDIA H200
#  Rank  8 Group  0 Pid   6733 on      hgx-c device  0 [0x18] NVIDIA H200
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
   268435456      67108864     float     sum      -1   1711.2  156.87  294.13      0   1702.5  157.67  295.63      0
  1073741824     268435456     float     sum      -1   6552.1  163.88  307.27      0   6549.0  163.95  307.41      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 301.11 
#

"""  # noqa: E501, W291


def test_all_reduce_rows_and_average_bus_bandwidth() -> None:
    report = parse_all_reduce_perf(ALL_REDUCE.splitlines())
    assert report.rows == ((268435456, 294.13, 295.63), (1073741824, 307.27, 307.41))
    assert (report.avg_busbw, report.out_of_bounds) == (301.11, 0)


def test_a_failed_all_reduce_has_no_figure() -> None:
    # the real nccl-tests failure (fixtures/real/h20_error-802_nccl-tests.txt, the part
    # all_reduce_perf and mpirun print)
    failed = [
        "# Using devices",
        "gpu: Test CUDA failure common.cu:1030 'system not yet initialized'",
        " .. gpu pid 3018: Test failure common.cu:937",
        "--------------------------------------------------------------------------",
        "Primary job  terminated normally, but 1 process returned",
        "a non-zero exit code. Per user-direction, the job has been aborted.",
    ]
    report = parse_all_reduce_perf(failed)
    assert report.rows == () and report.avg_busbw is None and report.out_of_bounds is None
