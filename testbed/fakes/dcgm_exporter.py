#!/usr/bin/python3
"""SIMULATED NVIDIA DCGM exporter for hgxserve test hosts (there is no GPU and no DCGM here).

Test equipment, not an exporter. It takes the real `dcgm-exporter` options the monitoring unit
passes (`-f COUNTERS.csv -a [HOST]:PORT`) and serves `/metrics` in the real exporter's format:
DCGM field names from the counters file (`DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_DEV_FB_USED`, ...) with
its labels (`gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname`,
`DCGM_FI_DRIVER_VERSION`). The GPUs, their names, bus ids, idle temperature and power come from
the real nvidia-smi captures the fake `nvidia-smi` prints (testbed/fakes/nvidia_smi.py, installed
beside this file); memory in use from the simulated engines' GPU memory files. A GPU holding an
engine's memory reads as busy, one without as idle.

Failure knobs: a file `/run/hgxserve-sim/dcgm/<gpu>.xid` holding a number makes that GPU report
that XID (DCGM_FI_DEV_XID_ERRORS), `<gpu>.ecc_dbe` a count of double-bit ECC errors.

The test hosts get it inside a stand-in `datacenter-gpu-manager-exporter` package
(testbed/dcgm_packages.py) at the real binary path, /usr/bin/dcgm-exporter.
"""

from __future__ import annotations

import http.server
import socket
import sys
import time
from pathlib import Path

LIB = Path("/usr/local/lib/hgxserve-testbed")
KNOBS = Path("/run/hgxserve-sim/dcgm")
STARTED = time.time()


def load_nvidia_smi():  # type: ignore[no-untyped-def]
    here = Path(__file__).resolve().parent
    for where in (here, LIB):
        if (where / "nvidia_smi.py").is_file():
            sys.path.insert(0, str(where))
            break
    import nvidia_smi  # noqa: PLC0415  (the fake, installed beside this file on test hosts)

    return nvidia_smi


def counters(path: str) -> list[tuple[str, str, str]]:
    """(field, type, help) rows of a dcgm-exporter counters CSV."""
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and parts[0].startswith("DCGM_FI_"):
            rows.append((parts[0], parts[1], parts[2]))
    return rows


def knob(gpu: int, name: str) -> int:
    try:
        return int((KNOBS / f"{gpu}.{name}").read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def values(gpu, busy: bool, uptime: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    util = 40.0 if busy else 0.0
    power_cap = float(gpu.power_cap_w or 700)
    return {
        "DCGM_FI_DEV_GPU_UTIL": util,
        "DCGM_FI_DEV_FB_USED": float(gpu.used_mib),
        "DCGM_FI_DEV_FB_FREE": float(max(gpu.total_mib - gpu.used_mib, 0)),
        "DCGM_FI_DEV_POWER_USAGE": min(float(gpu.power_w) + util * 5, power_cap),
        "DCGM_FI_DEV_GPU_TEMP": float(gpu.temp_c) + util / 4,
        "DCGM_FI_DEV_MEMORY_TEMP": float(gpu.temp_c) + 4 + util / 4,
        "DCGM_FI_DEV_SM_CLOCK": 1980.0 if busy else 345.0,
        "DCGM_FI_DEV_MEM_CLOCK": 3201.0,
        "DCGM_FI_DEV_XID_ERRORS": float(knob(gpu.index, "xid")),
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0.0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": float(knob(gpu.index, "ecc_dbe")),
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0.0,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0.0,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 0.0,
        "DCGM_FI_DEV_THERMAL_VIOLATION": 0.0,
        "DCGM_FI_DEV_POWER_VIOLATION": 0.0,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0.0,
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": float(int(uptime * (util * 1e6))),
        "DCGM_FI_PROF_SM_ACTIVE": util / 100 * 1.2,
        "DCGM_FI_PROF_NVLINK_TX_BYTES": float(int(uptime * util * 2.5e7)),
        "DCGM_FI_PROF_NVLINK_RX_BYTES": float(int(uptime * util * 2.5e7)),
    }


def render(counters_file: str) -> str:
    smi = load_nvidia_smi()
    table = smi.load_table(smi.gpu_kind())
    hostname = socket.gethostname()
    uptime = time.time() - STARTED
    out: list[str] = []
    rows = counters(counters_file)
    per_gpu = [(gpu, values(gpu, gpu.used_mib > 0, uptime)) for gpu in table.gpus]
    for field, kind, text in rows:
        out.append(f"# HELP {field} {text}")
        out.append(f"# TYPE {field} {kind}")
        for gpu, vals in per_gpu:
            if field not in vals:
                continue
            labels = (
                f'gpu="{gpu.index}",UUID="{gpu.uuid}",pci_bus_id="{gpu.bus_id}",'
                f'device="nvidia{gpu.index}",modelName="{gpu.name}",Hostname="{hostname}",'
                f'DCGM_FI_DRIVER_VERSION="{table.driver}"'
            )
            value = vals[field]
            out.append(f"{field}{{{labels}}} {value:g}" if value == int(value) else
                       f"{field}{{{labels}}} {value}")  # fmt: skip
    return "\n".join(out) + "\n"


def parse(argv: list[str]) -> tuple[str, str, int]:
    counters_file = "/etc/dcgm-exporter/default-counters.csv"
    address = ":9400"
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word in ("-f", "--collectors") and rest:
            counters_file = rest.pop(0)
        elif word in ("-a", "--address") and rest:
            address = rest.pop(0)
        elif word.startswith("--collectors="):
            counters_file = word.split("=", 1)[1]
        elif word.startswith("--address="):
            address = word.split("=", 1)[1]
        else:
            raise SystemExit(f"dcgm-exporter (simulated): unknown argument {word!r}")
    host, _, port = address.rpartition(":")
    return counters_file, host or "0.0.0.0", int(port)


def main(argv: list[str]) -> int:
    counters_file, host, port = parse(argv)
    counters(counters_file)  # fail at start, as the real one does, on a missing file

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = render(counters_file).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    print(f"dcgm-exporter (SIMULATED, hgxserve testbed): serving :{port}/metrics", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
