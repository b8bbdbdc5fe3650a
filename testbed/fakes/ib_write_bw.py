#!/usr/bin/python3
"""Simulated perftest ``ib_write_bw`` for hgxserve test hosts: a real TCP exchange between two
hosts, then perftest's own report format, with faults injectable per host.

Installed as /usr/local/bin/ib_write_bw. As the real tool: without a server address it is the
server and waits on ``-p PORT`` (default 18515) for one client; with one it is the client and
connects to it (``Couldn't connect to ADDRESS:PORT`` when nothing listens). Both ends check their
own port first and stop as perftest does when it is not ACTIVE (`` Port number 1 state is
Down``). The port is the simulated sysfs the test hosts have instead of /sys/class/infiniband
(testbed.hosts.SIM_RDMA_DIR: ``<dev>/ports/1/{state,rate,link_layer,gids/N}``).

Instead of RDMA writes, the client sends 1 MiB over the TCP connection, and both print the
bandwidth the rails would give: 97% of the lower of the two ports' sysfs rates, times each
host's ``bw_factor`` from /etc/hgxserve-testbed/fabric (``bw_factor: 0.5`` for every rail,
``bw_factor mlx5_1: 0.5`` for one), so a fault on either host shows in the figure.

The report lines are perftest_parameters.h's RESULT_LINE, RESULT_FMT_G and REPORT_FMT (printed
with ``--report_gbits``); the header block follows ib_write_bw's (linux-rdma/perftest).

Example::

    ib_write_bw -d mlx5_0 -p 18515 -F --report_gbits              # on hgx-b
    ib_write_bw -d mlx5_0 -p 18515 -F --report_gbits 10.77.0.12   # on hgx-a
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from pathlib import Path

# the simulated sysfs (as the simulated engine's HGXSERVE_SIM_RDMA_DIR) and the fault file
SYSFS = Path(os.environ.get("HGXSERVE_SIM_RDMA_DIR") or "/var/lib/hgxserve-sim/infiniband")
FAULTS = Path(os.environ.get("HGXSERVE_SIM_FABRIC_FAULTS") or "/etc/hgxserve-testbed/fabric")
DEFAULT_PORT = 18515
SIZE, ITERATIONS = 65536, 5000
PAYLOAD = 1 << 20
ACCEPT_WAIT_S = 60.0
RESULT_LINE = "-" * 87
RESULT_FMT_G = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
REPORT_FMT = " %-7lu    %d           %-7.2lf            %-7.2lf\t\t   %-7.6lf"
PORT_STATES = {"NOP": "Nop", "DOWN": "Down", "INIT": "Init", "ARMED": "Armed", "ACTIVE": "Active"}


class FakeError(Exception):
    pass


def _args(argv: list[str]) -> tuple[dict[str, str], str | None]:
    """({option: value}, server address or None) for the options the preflight passes."""
    opts: dict[str, str] = {}
    server = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-d", "-p", "-x", "-i", "-s", "-n", "-D"):
            if i + 1 >= len(argv):
                raise FakeError(f"option {arg} needs a value")
            opts[arg] = argv[i + 1]
            i += 2
            continue
        if arg in ("-F", "--report_gbits"):
            opts[arg] = ""
        elif arg.startswith("-"):
            raise FakeError(f"this simulated ib_write_bw does not take {arg}")
        else:
            server = arg
        i += 1
    if "-d" not in opts:
        raise FakeError("this simulated ib_write_bw needs -d DEVICE")
    return opts, server


def _read(path: Path) -> str:
    return path.read_text().strip() if path.is_file() else ""


def _port(device: str, ib_port: str) -> dict[str, str]:
    base = SYSFS / device / "ports" / ib_port
    if not base.is_dir():
        raise FakeError(f"no simulated device {device} port {ib_port} under {SYSFS}")
    state = _read(base / "state").partition(":")[2].strip() or "DOWN"
    if state != "ACTIVE":
        print(f" Port number {ib_port} state is {PORT_STATES.get(state, state)}", file=sys.stderr)
        sys.exit(1)
    return {"rate": _read(base / "rate"), "factor": str(_factor(device))}


def _factor(device: str) -> float:
    factor = 1.0
    for line in _read(FAULTS).splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("bw_factor", f"bw_factor {device}"):
            factor = float(value)
    return factor


def _gbps(mine: dict[str, str], theirs: dict[str, str]) -> float:
    rates = [float(p["rate"].split()[0]) for p in (mine, theirs) if p["rate"]]
    return min(rates) * 0.97 * float(mine["factor"]) * float(theirs["factor"])


def _report(opts: dict[str, str], gbps: float) -> str:
    peak = gbps * random.uniform(1.0, 1.002)
    rate = gbps * 1e9 / 8 / SIZE / 1e6
    link = "Ethernet" if "-x" in opts else "IB"
    gid = [f" GID index       : {opts['-x']}"] if "-x" in opts else []
    lines = [
        RESULT_LINE,
        "                    RDMA_Write BW Test",
        f" Dual-port       : OFF\t\tDevice         : {opts['-d']}",
        " Number of qps   : 1\t\tTransport type : IB",
        " Connection type : RC\t\tUsing SRQ      : OFF",
        " PCIe relax order: ON",
        " ibv_wr* API     : ON",
        " TX depth        : 128",
        " CQ Moderation   : 1",
        " Mtu             : 4096[B]",
        f" Link type       : {link}",
        *gid,
        " Max inline data : 0[B]",
        " rdma_cm QPs\t : OFF",
        " Data ex. method : Ethernet",
        RESULT_LINE,
        RESULT_FMT_G,
        REPORT_FMT % (SIZE, ITERATIONS, peak, gbps, rate),
        RESULT_LINE,
    ]
    return "\n".join(lines) + "\n"


def _exchange(sock: socket.socket, mine: dict[str, str], send_payload: bool) -> dict[str, str]:
    sock.sendall((json.dumps(mine) + "\n").encode())
    stream = sock.makefile("rb")
    theirs: dict[str, str] = json.loads(stream.readline())
    if send_payload:
        sock.sendall(b"\0" * PAYLOAD)
        stream.readline()
    else:
        left = PAYLOAD
        while left > 0:
            chunk = stream.read(min(left, 65536))
            if not chunk:
                raise FakeError("the client went away mid-test")
            left -= len(chunk)
        sock.sendall(b"done\n")
    return theirs


def main(argv: list[str]) -> str:
    opts, server = _args(argv)
    mine = _port(opts["-d"], opts.get("-i", "1"))
    port = int(opts.get("-p", DEFAULT_PORT))
    if server is None:
        with socket.create_server(("0.0.0.0", port)) as listener:
            listener.settimeout(ACCEPT_WAIT_S)
            conn, _ = listener.accept()
            with conn:
                theirs = _exchange(conn, mine, send_payload=False)
    else:
        try:
            conn = socket.create_connection((server, port), timeout=10)
        except OSError:
            print(f"Couldn't connect to {server}:{port}", file=sys.stderr)
            sys.exit(1)
        with conn:
            theirs = _exchange(conn, mine, send_payload=True)
    return _report(opts, _gbps(mine, theirs))


if __name__ == "__main__":
    try:
        sys.stdout.write(main(sys.argv[1:]))
    except FakeError as exc:
        print(f"ib_write_bw (hgxserve test host simulation): {exc}", file=sys.stderr)
        sys.exit(1)
