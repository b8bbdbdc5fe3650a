#!/usr/bin/python3
"""Simulated ``nvidia-smi`` for hgxserve test hosts: real captured output, simulated memory use.

Installed as /usr/local/bin/nvidia-smi on test hosts. It prints output captured on real
8xH200 / 8xH20-3e machines (fixtures/, one ``# source:`` header line each, stripped here) and
overlays only what the simulated engines change: per-GPU memory in use and the process list,
read from /run/hgxserve-sim/gpus/<gpu_index>.json files whose pid is alive.

Example::

    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

KINDS = {
    "h200": {
        "table": "h200_nvidia-smi.txt",
        "query": "h200_nvidia-smi-q.txt",
        "topo": "h200_topo-m.txt",
        # The 8xH200 table has its own Processes box (570 driver layout).
        "processes": "h200_nvidia-smi.txt",
    },
    "h20": {
        "table": "h20-3e_nvidia-smi.txt",
        # No H20 -q capture exists; the H200 one gives the layout, the H20 table the values.
        "query": "h200_nvidia-smi-q.txt",
        "topo": "h20-3e_topo-m.txt",
        # The H20-3e paste omits its Processes box; an H20 capture on a 550 driver has one.
        "processes": "h20_1gpu-vm_nvidia-smi.txt",
    },
}
DEFAULT_SHARE = Path("/usr/local/share/hgxserve-testbed/fixtures")
DEFAULT_KIND_FILE = Path("/etc/hgxserve-testbed/gpu")
DEFAULT_SIM_GPU_DIR = Path("/run/hgxserve-sim/gpus")

QUERY_GPU_FIELDS = {
    # field: (csv header, unit or "")
    "index": ("index", ""),
    "name": ("name", ""),
    "uuid": ("uuid", ""),
    "pci.bus_id": ("pci.bus_id", ""),
    "memory.total": ("memory.total [MiB]", "MiB"),
    "memory.used": ("memory.used [MiB]", "MiB"),
    "memory.free": ("memory.free [MiB]", "MiB"),
    "driver_version": ("driver_version", ""),
    "persistence_mode": ("persistence_mode", ""),
    "mig.mode.current": ("mig.mode.current", ""),
    "power.draw": ("power.draw [W]", "W"),
    "utilization.gpu": ("utilization.gpu [%]", "%"),
}
QUERY_APPS_FIELDS = {
    "gpu_uuid": ("gpu_uuid", ""),
    "pid": ("pid", ""),
    "process_name": ("process_name", ""),
    "used_memory": ("used_gpu_memory [MiB]", "MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB"),
}

GPU_LINE = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(On|Off)\s+\|\s+(\S+)\s+(On|Off)\s+\|")
STATS_LINE = re.compile(
    r"^\|\s*(\S+)\s+(\d+)C\s+(P\d+)\s+(\d+)W\s*/\s*(\d+)W\s+\|\s*(\d+)MiB\s*/\s*(\d+)MiB\s+\|"
)
MIG_LINE = re.compile(r"^\|\s+\|\s+\|\s+(\S+)\s+\|$")
MEMORY_CELL = re.compile(r"\|(\s*\d+MiB /\s*\d+MiB) \|")
VERSIONS_LINE = re.compile(r"Driver Version:\s+(\S+)\s+CUDA Version:\s+(\S+)")


class FakeError(Exception):
    """A usage error: printed on stderr, exit status 2 (unknown invocations, bad fields)."""


@dataclass
class Gpu:
    index: int
    name: str
    persistence: str
    bus_id: str
    temp_c: int
    perf: str
    power_w: int
    power_cap_w: int
    total_mib: int
    mig: str
    used_mib: int = 0
    processes: list[Process] = field(default_factory=list)

    @property
    def uuid(self) -> str:
        # Same anonymised UUID scheme as the fixtures (GPU-...N, N = index + 1).
        return f"GPU-00000000-0000-0000-0000-{self.index + 1:012d}"


@dataclass
class Process:
    gpu: int
    pid: int
    used_mib: int
    name: str


@dataclass
class Table:
    lines: list[str]
    driver: str
    cuda: str
    gpus: list[Gpu]


def fixture_dir() -> Path:
    override = os.environ.get("HGXSERVE_FAKE_FIXTURES")
    if override:
        return Path(override)
    beside = Path(__file__).resolve().parent / "fixtures"
    return beside if beside.is_dir() else DEFAULT_SHARE


def gpu_kind() -> str:
    kind = os.environ.get("HGXSERVE_FAKE_GPU", "")
    if not kind and DEFAULT_KIND_FILE.is_file():
        kind = DEFAULT_KIND_FILE.read_text().strip()
    kind = kind or "h200"
    if kind not in KINDS:
        raise FakeError(f"unknown simulated GPU kind {kind!r} (known: {', '.join(KINDS)})")
    return kind


def read_fixture(name: str) -> list[str]:
    """Return the captured output lines of a fixture, without its ``# source:`` header."""
    lines = (fixture_dir() / name).read_text().split("\n")
    if not lines[0].startswith("# source:"):
        raise FakeError(f"fixture {name} has no '# source:' header line")
    body = lines[1:]
    if body and body[-1] == "":
        body.pop()
    return body


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie has freed its memory; only its exit status is left.
    return stat.rpartition(")")[2].split()[0] != "Z"


def sim_processes() -> list[Process]:
    """Read the simulated engines' GPU memory files, keeping those whose pid is alive."""
    gpus_dir = Path(os.environ.get("HGXSERVE_SIM_GPU_DIR") or DEFAULT_SIM_GPU_DIR)
    found = []
    for path in sorted(gpus_dir.glob("*.json")) if gpus_dir.is_dir() else []:
        try:
            gpu = int(path.stem)
            data = json.loads(path.read_text())
            pid = int(data["pid"])
            used = int(data["used_mib"])
            name = str(data.get("process_name", "python3"))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written or foreign file: a real driver would not see it either
        if pid_alive(pid):
            found.append(Process(gpu=gpu, pid=pid, used_mib=used, name=name))
        else:
            # a dead process holds no memory: its file goes (when this user may remove it),
            # so an engine of another user can write that GPU's file again in the sticky dir
            with contextlib.suppress(OSError):
                path.unlink()
    return found


def load_table(kind: str) -> Table:
    lines = read_fixture(KINDS[kind]["table"])
    versions = next(m for m in map(VERSIONS_LINE.search, lines) if m)
    gpus: list[Gpu] = []
    for number, line in enumerate(lines):
        head = GPU_LINE.match(line)
        if not head:
            continue
        stats = STATS_LINE.match(lines[number + 1])
        mig = MIG_LINE.match(lines[number + 2])
        if not stats or not mig:
            raise FakeError(f"cannot read GPU {head.group(1)} in fixture {KINDS[kind]['table']}")
        gpus.append(
            Gpu(
                index=int(head.group(1)),
                name=head.group(2),
                persistence=head.group(3),
                bus_id=head.group(4),
                temp_c=int(stats.group(2)),
                perf=stats.group(3),
                power_w=int(stats.group(4)),
                power_cap_w=int(stats.group(5)),
                total_mib=int(stats.group(7)),
                mig=mig.group(1),
            )
        )
    by_index = {gpu.index: gpu for gpu in gpus}
    for proc in sim_processes():
        if proc.gpu in by_index:
            by_index[proc.gpu].processes.append(proc)
            by_index[proc.gpu].used_mib += proc.used_mib
    return Table(lines=lines, driver=versions.group(1), cuda=versions.group(2), gpus=gpus)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def process_row(header: str, proc: Process) -> str:
    """Format one Processes-box row with the column stops of the captured header line."""
    pid_end = header.index("PID") + 3
    type_end = header.index("Type") + 4
    name_start = header.index("Process name")
    memory = _fit(f"{proc.used_mib}MiB", 8)
    name = (
        proc.name if len(proc.name) <= 80 - name_start else "..." + proc.name[-(77 - name_start) :]
    )
    row = f"|{proc.gpu:>5}{'N/A':>6}{'N/A':>5}"
    row += f"{proc.pid:>{pid_end - len(row)}}"
    row += f"{'C':>{type_end - len(row)}}"
    row += " " * (name_start - len(row))
    return row + f"{name:<{80 - name_start}} {memory:>8} |"


def render_table(kind: str) -> str:
    table = load_table(kind)
    lines = list(table.lines)
    by_index = {gpu.index: gpu for gpu in table.gpus}
    current: Gpu | None = None
    for number, line in enumerate(lines):
        head = GPU_LINE.match(line)
        if head:
            current = by_index[int(head.group(1))]
            continue
        cell = MEMORY_CELL.search(line)
        if cell and current is not None:
            # The captured "used" values came from the poster's own processes; here memory in
            # use is exactly what the simulated engines report.
            text = f"{current.used_mib}MiB / {current.total_mib}MiB"
            width = len(cell.group(1))
            lines[number] = line[: cell.start(1)] + f"{text:>{width}}" + line[cell.end(1) :]
            current = None
    box_start = next((n for n, line in enumerate(lines) if line.startswith("| Processes:")), None)
    if box_start is None:
        template = read_fixture(KINDS[kind]["processes"])
        start = next(n for n, line in enumerate(template) if line.startswith("| Processes:"))
        lines += template[start - 2 :]
        box_start = len(lines) - len(template) + start
    header = lines[box_start + 1]
    rule = next(n for n in range(box_start, len(lines)) if lines[n].startswith("|==="))
    bottom = next(n for n in range(rule, len(lines)) if lines[n].startswith("+---"))
    procs = [p for gpu in table.gpus for p in gpu.processes]
    if procs:
        lines[rule + 1 : bottom] = [process_row(header, p) for p in procs]
    return "\n".join(lines) + "\n"


def render_list(kind: str) -> str:
    return "".join(
        f"GPU {gpu.index}: {gpu.name} (UUID: {gpu.uuid})\n" for gpu in load_table(kind).gpus
    )


def _replace_value(block: list[str], key: str, value: str, occurrence: int = 0) -> None:
    """Set the value of the ``occurrence``-th line whose label (before ':') is ``key``."""
    seen = 0
    for number, line in enumerate(block):
        label, sep, _ = line.partition(":")
        if sep and label.strip() == key:
            if seen == occurrence:
                block[number] = f"{label}: {value}"
                return
            seen += 1
    raise FakeError(f"-q template has no '{key}' line")


def _section_value(block: list[str], section: str, key: str, value: str) -> None:
    start = next(n for n, line in enumerate(block) if line.strip() == section)
    indent = len(block[start]) - len(block[start].lstrip())
    for number in range(start + 1, len(block)):
        line = block[number]
        if len(line) - len(line.lstrip()) <= indent:
            break
        label, sep, _ = line.partition(":")
        if sep and label.strip() == key:
            block[number] = f"{label}: {value}"
            return
    raise FakeError(f"-q template has no '{section}/{key}' line")


def reserved_mib(kind: str) -> int:
    """FB memory the driver reserves, as the -q capture reports it (used + free + this = total)."""
    line = next(
        ln for ln in read_fixture(KINDS[kind]["query"]) if ln.strip().startswith("Reserved")
    )
    return int(re.sub(r"\D", "", line))


def render_query(kind: str) -> str:
    table = load_table(kind)
    template = read_fixture(KINDS[kind]["query"])
    first_gpu = next(n for n, line in enumerate(template) if line.startswith("GPU "))
    head = template[:first_gpu]
    _replace_value(head, "Driver Version", table.driver)
    _replace_value(head, "CUDA Version", table.cuda)
    _replace_value(head, "Attached GPUs", str(len(table.gpus)))
    out = list(head)
    for gpu in table.gpus:
        block = list(template[first_gpu:])
        block[0] = f"GPU {gpu.bus_id}"
        bus = gpu.bus_id.split(":")
        _replace_value(block, "Product Name", gpu.name)
        _replace_value(
            block, "Persistence Mode", "Enabled" if gpu.persistence == "On" else "Disabled"
        )
        _section_value(block, "MIG Mode", "Current", gpu.mig)
        _replace_value(block, "Serial Number", f"{gpu.index + 1:013d}")
        _replace_value(block, "GPU UUID", gpu.uuid)
        _replace_value(block, "Minor Number", str(gpu.index))
        _replace_value(block, "GSP Firmware Version", table.driver)
        _section_value(block, "PCI", "Bus", f"0x{bus[1]}")
        _section_value(block, "PCI", "Bus Id", gpu.bus_id)
        _replace_value(block, "Performance State", gpu.perf)
        total = gpu.total_mib
        reserved = reserved_mib(kind)
        _section_value(block, "FB Memory Usage", "Total", f"{total} MiB")
        _section_value(block, "FB Memory Usage", "Used", f"{gpu.used_mib} MiB")
        _section_value(block, "FB Memory Usage", "Free", f"{total - reserved - gpu.used_mib} MiB")
        _section_value(block, "Temperature", "GPU Current Temp", f"{gpu.temp_c} C")
        _section_value(block, "GPU Power Readings", "Power Draw", f"{gpu.power_w:.2f} W")
        cap = f"{gpu.power_cap_w:.2f} W"
        for key in ("Current Power Limit", "Requested Power Limit", "Default Power Limit"):
            _section_value(block, "GPU Power Readings", key, cap)
        _section_value(block, "GPU Power Readings", "Max Power Limit", cap)
        processes = next(n for n, line in enumerate(block) if line.strip().startswith("Processes"))
        if gpu.processes:
            rows = ["    Processes"]
            for proc in gpu.processes:
                rows += [
                    "        GPU instance ID                   : N/A",
                    "        Compute instance ID               : N/A",
                    f"        Process ID                        : {proc.pid}",
                    "            Type                          : C",
                    f"            Name                          : {proc.name}",
                    f"            Used GPU Memory               : {proc.used_mib} MiB",
                ]
            block[processes : processes + 1] = rows
        out += block
        out.append("")
    return "\n".join(out) + "\n"


def parse_format(value: str) -> tuple[bool, bool]:
    options = [part.strip() for part in value.split(",") if part.strip()]
    if not options or options[0] != "csv" or set(options[1:]) - {"noheader", "nounits"}:
        raise FakeError(
            f'"{value}" is not a valid format (this simulation supports csv[,noheader][,nounits])'
        )
    return "noheader" not in options, "nounits" not in options


def render_csv(
    fields: list[str], known: dict[str, tuple[str, str]], rows: list[dict[str, str]], fmt: str
) -> str:
    header, units = parse_format(fmt)
    for name in fields:
        if name not in known:
            raise FakeError(f'Field "{name}" is not a valid field to query.')
    out = []
    if header:
        out.append(", ".join(known[name][0] if units else name for name in fields))
    for row in rows:
        cells = []
        for name in fields:
            unit = known[name][1]
            cells.append(f"{row[name]} {unit}" if unit and units else row[name])
        out.append(", ".join(cells))
    return "".join(line + "\n" for line in out)


def render_query_gpu(kind: str, fields: list[str], fmt: str) -> str:
    table = load_table(kind)
    reserved = reserved_mib(kind)
    rows = []
    for gpu in table.gpus:
        rows.append(
            {
                "index": str(gpu.index),
                "name": gpu.name,
                "uuid": gpu.uuid,
                "pci.bus_id": gpu.bus_id,
                "memory.total": str(gpu.total_mib),
                "memory.used": str(gpu.used_mib),
                "memory.free": str(gpu.total_mib - gpu.used_mib - reserved),
                "driver_version": table.driver,
                "persistence_mode": "Enabled" if gpu.persistence == "On" else "Disabled",
                "mig.mode.current": gpu.mig,
                **busy_readings(gpu),
            }
        )
    return render_csv(fields, QUERY_GPU_FIELDS, rows, fmt)


def busy_readings(gpu: Gpu) -> dict[str, str]:
    """Power and utilisation: the capture's idle power draw; a GPU holding a simulated engine's
    memory reads 40 % busy and 5 W per busy % more, up to its cap (the simulated DCGM exporter's
    model, testbed/fakes/dcgm_exporter.py)."""
    util = 40 if gpu.used_mib > 0 else 0
    power = min(gpu.power_w + util * 5, gpu.power_cap_w or 700)
    return {"power.draw": f"{power:.2f}", "utilization.gpu": str(util)}


def render_query_apps(kind: str, fields: list[str], fmt: str) -> str:
    table = load_table(kind)
    rows = []
    for gpu in table.gpus:
        for proc in gpu.processes:
            used = str(proc.used_mib)
            rows.append(
                {
                    "gpu_uuid": gpu.uuid,
                    "pid": str(proc.pid),
                    "process_name": proc.name,
                    "used_memory": used,
                    "used_gpu_memory": used,
                }
            )
    return render_csv(fields, QUERY_APPS_FIELDS, rows, fmt)


def _options(argv: list[str]) -> dict[str, str]:
    """Parse ``--key=value`` / ``--key value`` options; anything else is an unknown invocation."""
    options: dict[str, str] = {}
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if not word.startswith("--"):
            raise FakeError(f"unexpected argument {word!r}")
        key, sep, value = word[2:].partition("=")
        if not sep:
            if not rest:
                raise FakeError(f"option --{key} needs a value")
            value = rest.pop(0)
        options[key] = value
    return options


def main(argv: list[str]) -> str:
    """Return what nvidia-smi prints for ``argv``; raise FakeError for unsupported invocations."""
    kind = gpu_kind()
    if not argv:
        return render_table(kind)
    if argv == ["-q"]:
        return render_query(kind)
    if argv == ["-L"]:
        return render_list(kind)
    if argv == ["topo", "-m"]:
        return "\n".join(read_fixture(KINDS[kind]["topo"])) + "\n"
    options = _options(argv)
    fmt = options.pop("format", None)
    for query, render in (
        ("query-gpu", render_query_gpu),
        ("query-compute-apps", render_query_apps),
    ):
        if query in options:
            wanted = options.pop(query)
            if options or fmt is None:
                break
            return render(kind, [f.strip() for f in wanted.split(",") if f.strip()], fmt)
    raise FakeError(
        "this simulated nvidia-smi supports only: (no arguments), -q, -L, topo -m, "
        "--query-gpu=FIELDS --format=csv[,noheader][,nounits], "
        "--query-compute-apps=FIELDS --format=csv[,noheader][,nounits]"
    )


if __name__ == "__main__":
    try:
        sys.stdout.write(main(sys.argv[1:]))
    except FakeError as exc:
        print(f"nvidia-smi (hgxserve test host simulation): {exc}", file=sys.stderr)
        sys.exit(2)
