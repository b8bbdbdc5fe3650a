#!/usr/bin/python3
"""Simulated nccl-tests ``all_reduce_perf`` for hgxserve test hosts: the ranks that the
simulated mpirun (testbed/fakes/mpirun.py) starts on each host really meet over TCP, and rank 0
prints nccl-tests' output format (src/common.cu: the `# nThread` line, `# Using devices`, the
Reporter's table, `# Out of bounds values`, `# Avg bus bandwidth`).

The SIMULATED bus bandwidth is what the hosts' rails would carry: for each host the rails named
in NCCL_IB_HCA that are ACTIVE in its simulated sysfs (as NCCL skips ports that are not), their
sysfs rates times the host's ``bw_factor`` (/etc/hgxserve-testbed/fabric, as the simulated
ib_write_bw reads it), summed; the slowest host's sum, at 92%, in GB/s.

Rank, size and rank 0's address come from the simulated mpirun (HGXSERVE_SIM_MPI_RANK,
HGXSERVE_SIM_MPI_SIZE, HGXSERVE_SIM_MPI_ROOT=address:port), as a real MPI launcher hands them
over. Options taken: -b/-e SIZE, -g GPUS, -n ITERS.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "/usr/local/lib/hgxserve-testbed")  # where the hosts keep it as a module
from ib_write_bw import SYSFS, FakeError, _factor, _read  # noqa: E402

GPU_NAMES = {"h200": "NVIDIA H200", "h20": "NVIDIA H20"}
KIND_FILE = Path("/etc/hgxserve-testbed/gpu")
PAYLOAD = 1 << 20
CONNECT_WAIT_S = 30.0
EFFICIENCY = 0.92


def _size(text: str) -> int:
    units = {"G": 1 << 30, "M": 1 << 20, "K": 1 << 10}
    unit = units.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


def _options(argv: list[str]) -> dict[str, str]:
    opts = {"-b": "32M", "-e": "32M", "-g": "1", "-n": "20"}
    for flag, value in zip(argv[::2], argv[1::2], strict=False):
        if flag not in opts:
            raise FakeError(f"this simulated all_reduce_perf does not take {flag}")
        opts[flag] = value
    if len(argv) % 2:
        raise FakeError(f"option {argv[-1]} needs a value")
    return opts


def _host_gbps() -> float:
    """This host's rails' bandwidth as NCCL would use it (Gb/s)."""
    total = 0.0
    for rail in filter(None, os.environ.get("NCCL_IB_HCA", "").split(",")):
        port = SYSFS / rail / "ports" / "1"
        if _read(port / "state").partition(":")[2].strip() != "ACTIVE":
            continue
        rate = _read(port / "rate").split()
        total += (float(rate[0]) if rate else 0.0) * _factor(rail)
    return total


def _me(gpus: int) -> dict[str, object]:
    return {"host": socket.gethostname(), "gbps": _host_gbps(), "gpus": gpus, "pid": os.getpid()}


def _gather(root: str, size: int, mine: dict[str, object]) -> list[dict[str, object]]:
    """Rank 0: accept the other ranks, take each one's figures and 1 MiB."""
    host, _, port = root.rpartition(":")
    ranks = [mine]
    with socket.create_server((host, int(port))) as listener:
        listener.settimeout(CONNECT_WAIT_S)
        for _ in range(size - 1):
            conn, _ = listener.accept()
            with conn:
                stream = conn.makefile("rb")
                ranks.append(json.loads(stream.readline()))
                left = PAYLOAD
                while left > 0:
                    chunk = stream.read(min(left, 65536))
                    if not chunk:
                        raise FakeError("a rank went away mid-test")
                    left -= len(chunk)
                conn.sendall(b"done\n")
    return ranks


def _join(root: str, mine: dict[str, object]) -> None:
    """Ranks > 0: reach rank 0 (retrying while it starts), hand over figures and 1 MiB."""
    host, _, port = root.rpartition(":")
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            conn = socket.create_connection((host, int(port)), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise FakeError(f"rank 0 at {root} did not answer") from None
            time.sleep(0.2)
    with conn:
        conn.sendall((json.dumps(mine) + "\n").encode() + b"\0" * PAYLOAD)
        conn.makefile("rb").readline()


# nccl-tests src/common.cu's printf formats, as they are there
DEVICE_FMT = "#  Rank %2d Group %2d Pid %6d on %10s device %2d [0x%02x] %s"
META_FMT = (
    "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
)
NAMES_FMT = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
UNITS_FMT = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
PARAMS_FMT = "%12li  %12li  %8s  %6s  %6i"
RESULT_FMT = "  %7s  %6.2f  %6.2f  %5li"
AVG_FMT = "# Avg bus bandwidth    : %g %s"
NAMES = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
UNITS = ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")


def _report(opts: dict[str, str], ranks: list[dict[str, object]]) -> str:
    nbytes, gpus = _size(opts["-b"]), int(opts["-g"])
    name = GPU_NAMES.get(_read(KIND_FILE) or "h200", "NVIDIA H200")
    busbw = min(float(str(r["gbps"])) for r in ranks) * EFFICIENCY / 8
    nranks = len(ranks) * gpus
    algbw = busbw / (2 * (nranks - 1) / nranks) if nranks > 1 else busbw
    usec = f"{nbytes / (algbw * 1e9) * 1e6 if algbw > 0 else 0.0:.1f}"
    lines = [
        f"# nThread 1 nGpus {gpus} minBytes {nbytes} maxBytes {_size(opts['-e'])} step: "
        f"1048576(bytes) warmup iters: 5 iters: {opts['-n']} agg iters: 1 validation: 1 graph: 0",
        "#",
        "# Using devices",
    ]
    for proc, rank in enumerate(ranks):
        pid = int(str(rank["pid"]))
        for dev in range(gpus):
            args = (proc * gpus + dev, 0, pid, rank["host"], dev, 0x18 + dev, name)
            lines.append(DEVICE_FMT % args)
    row = PARAMS_FMT % (nbytes, nbytes // 4, "float", "sum", -1)
    row += (RESULT_FMT % (usec, algbw, busbw, 0)) * 2
    lines += [
        META_FMT % ("", "", "", "", ""),
        NAMES_FMT % (*NAMES, *NAMES[5:]),
        UNITS_FMT % (*UNITS, *UNITS[5:]),
        row,
        "# Out of bounds values : 0 OK",
        AVG_FMT % (round(busbw, 4), ""),
        "#",
        "",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> str:
    opts = _options(argv)
    rank = int(os.environ.get("HGXSERVE_SIM_MPI_RANK", "0"))
    size = int(os.environ.get("HGXSERVE_SIM_MPI_SIZE", "1"))
    root = os.environ.get("HGXSERVE_SIM_MPI_ROOT", "127.0.0.1:18600")
    mine = _me(int(opts["-g"]))
    if rank > 0:
        _join(root, mine)
        return ""
    return _report(opts, _gather(root, size, mine))


if __name__ == "__main__":
    try:
        sys.stdout.write(main(sys.argv[1:]))
    except FakeError as exc:
        print(f"all_reduce_perf (hgxserve test host simulation): {exc}", file=sys.stderr)
        sys.exit(1)
