"""GPU telemetry during a round: memory in use, power and utilisation of every GPU of the hosts.

Sampled once per `TELEMETRY_INTERVAL_S` while the round runs (seed 003 §8.3 sampled nvidia-smi
once per second), from the DCGM exporter where the topology deploys one (`monitoring.
dcgm_exporter`: `DCGM_FI_DEV_FB_USED` MiB, `DCGM_FI_DEV_POWER_USAGE` W, `DCGM_FI_DEV_GPU_UTIL`
%), else from `nvidia-smi --query-gpu=... --format=csv` over SSH (needs --inventory). Each host's
samples become min / mean / max per figure in run.json and the report.

>>> parse_nvidia_smi("index, memory.used [MiB], power.draw [W], utilization.gpu [%]\\n"
...                  "0, 130215 MiB, 402.17 W, 87 %\\n", "hgx-a")[0].power_w
402.17
"""

from __future__ import annotations

import re
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.promtext import parse_samples

NVIDIA_SMI_QUERY = (
    "nvidia-smi --query-gpu=index,memory.used,power.draw,utilization.gpu --format=csv"
)
DCGM_FIELDS = {
    "DCGM_FI_DEV_FB_USED": "memory_used_mib",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
}
SMI_FIELDS = {
    "memory.used": "memory_used_mib",
    "power.draw": "power_w",
    "utilization.gpu": "util_pct",
}
FIGURES = ("memory_used_mib", "power_w", "util_pct")
# Seed 003 §8.3: one sample per second.
TELEMETRY_INTERVAL_S = 1.0
# A 24 h round at one sample per second; samples beyond this are dropped (counted).
MAX_SAMPLES = 86_400
# One read of a host's telemetry (a DCGM scrape, one nvidia-smi over SSH).
READ_TIMEOUT_S = 10.0
_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class GpuSample:
    host: str
    gpu: str
    memory_used_mib: float | None
    power_w: float | None
    util_pct: float | None


def _number(cell: str) -> float | None:
    """`130215 MiB`, `402.17 W`, `87 %`, `87` -> the number; `[N/A]`, `[Not Supported]` -> None."""
    m = _NUMBER.match(cell)
    return float(m.group(1)) if m else None


def parse_dcgm(text: str, host: str) -> list[GpuSample]:
    """The GPUs of one DCGM exporter's /metrics (labels `gpu`, `UUID`, ...)."""
    by_gpu: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_samples(text):
        figure = DCGM_FIELDS.get(name)
        if figure is not None:
            by_gpu.setdefault(labels.get("gpu", "?"), {})[figure] = value
    return [
        GpuSample(host, gpu, v.get("memory_used_mib"), v.get("power_w"), v.get("util_pct"))
        for gpu, v in sorted(by_gpu.items())
    ]


def parse_nvidia_smi(text: str, host: str) -> list[GpuSample]:
    """`nvidia-smi --query-gpu=index,memory.used,... --format=csv` (header with units)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = [h.strip().split(" [")[0] for h in lines[0].split(",")]
    out = []
    for line in lines[1:]:
        cells = dict(zip(header, (c.strip() for c in line.split(",")), strict=False))
        values = {SMI_FIELDS[k]: _number(v) for k, v in cells.items() if k in SMI_FIELDS}
        out.append(
            GpuSample(
                host,
                cells.get("index", "?"),
                values.get("memory_used_mib"),
                values.get("power_w"),
                values.get("util_pct"),
            )
        )
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "mean": statistics.fmean(values), "max": max(values)}


def summarize(samples: list[GpuSample]) -> dict[str, dict[str, Any]]:
    """Per host: GPUs seen, samples, and min / mean / max of each figure over every GPU and
    sample."""
    out: dict[str, dict[str, Any]] = {}
    for host in sorted({s.host for s in samples}):
        mine = [s for s in samples if s.host == host]
        entry: dict[str, Any] = {"gpus": len({s.gpu for s in mine}), "samples": len(mine)}
        for figure in FIGURES:
            entry[figure] = _spread(
                [v for v in (getattr(s, figure) for s in mine) if v is not None]
            )
        out[host] = entry
    return out


Probe = Callable[[], list[GpuSample]]


@dataclass
class Sampler:
    """Calls `probe` every `interval_s` in a thread between start() and stop()."""

    probe: Probe
    source: str
    interval_s: float = TELEMETRY_INTERVAL_S
    samples: list[GpuSample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dropped: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample_once(self) -> None:
        try:
            got = self.probe()
        except Exception as exc:  # noqa: BLE001 - a failed read is recorded, the round goes on
            if len(self.errors) < 10:
                self.errors.append(str(exc))
            return
        room = MAX_SAMPLES - len(self.samples)
        self.samples.extend(got[: max(room, 0)])
        self.dropped += max(len(got) - max(room, 0), 0)

    def _loop(self) -> None:
        while True:
            self._sample_once()
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> None:
        self._stop.clear()
        self.samples, self.errors, self.dropped = [], [], 0
        self._thread = threading.Thread(target=self._loop, name="gpu-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the round's summary for run.json."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(READ_TIMEOUT_S * 2)
        return {
            "source": self.source,
            "interval_s": self.interval_s,
            "hosts": summarize(self.samples),
            "errors": self.errors,
            "dropped": self.dropped,
        }


def dcgm_probe(urls: dict[str, str], fetch: Callable[[str], str]) -> Probe:
    """Every host's DCGM exporter: host -> its /metrics URL."""

    def probe() -> list[GpuSample]:
        out: list[GpuSample] = []
        for host, url in urls.items():
            out += parse_dcgm(fetch(url), host)
        return out

    return probe


def smi_probe(run_all: Callable[[str, float], dict[str, Any]]) -> Probe:
    """`nvidia-smi --query-gpu` on every host over SSH (`Sessions.run_all`)."""

    def probe() -> list[GpuSample]:
        out: list[GpuSample] = []
        for host, result in run_all(NVIDIA_SMI_QUERY, READ_TIMEOUT_S).items():
            if not result.ok or result.exit_status != 0:
                raise RuntimeError(
                    f"{host}: nvidia-smi failed: {result.error or result.stderr.strip()[-200:]}"
                )
            out += parse_nvidia_smi(result.stdout, host)
        return out

    return probe


@dataclass
class Telemetry:
    """The sampler of one bench run and what it holds open (SSH sessions, tunnels)."""

    sampler: Sampler | None
    why_none: str = ""
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in self.closers:
            close()


def open_telemetry(topo: Any, inventory: str | None) -> Telemetry:
    """The DCGM exporter of every GPU host where the topology deploys it (through an SSH tunnel
    with an inventory, else at the host's address), else nvidia-smi over SSH with an inventory,
    else none (run.json says why)."""
    from hgxserve.bench.metrics import fetch_text

    gpu_hosts = sorted({h for e in topo.engines.values() for h in e.place})
    mon = topo.monitoring
    dcgm_port = mon.dcgm_exporter_port if mon is not None and mon.dcgm_exporter else None
    if inventory is None:
        if dcgm_port is None:
            return Telemetry(None, "no DCGM exporter in the topology and no --inventory for "
                             "nvidia-smi over SSH")  # fmt: skip
        urls = {h: f"http://{topo.hosts[h].address}:{dcgm_port}/metrics" for h in gpu_hosts}
        probe = dcgm_probe(urls, lambda u: fetch_text(u, READ_TIMEOUT_S))
        return Telemetry(Sampler(probe, "dcgm-exporter"))
    from hgxserve.remote.inventory import InventoryError, load_inventory
    from hgxserve.remote.ssh import Sessions
    from hgxserve.remote.tunnel import Tunnels

    try:
        hosts = load_inventory(inventory).select(gpu_hosts)
    except InventoryError as exc:
        return Telemetry(None, str(exc))
    if dcgm_port is not None:
        tunnels = Tunnels(hosts)
        urls = {h: tunnels.url(h, "127.0.0.1", dcgm_port) + "/metrics" for h in gpu_hosts}
        probe = dcgm_probe(urls, lambda u: fetch_text(u, READ_TIMEOUT_S))
        return Telemetry(Sampler(probe, "dcgm-exporter"), closers=[tunnels.close])
    sessions = Sessions(hosts)
    return Telemetry(Sampler(smi_probe(sessions.run_all), "nvidia-smi"), closers=[sessions.close])
