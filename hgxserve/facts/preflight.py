"""Compare a host's facts with what the topology expects of it: one message per mismatch.

`preflight_problems()` is pure: it takes the facts dict (`HOST_FACTS` names, as printed by
`hgxserve facts`) and a `HostExpectation`, and returns messages of the form
`HOST: FACT: expected X, found Y`. Checks that the provision stage itself fixes (shm, memlock,
peermem, Fabric Manager) can be left out with `after_provision=False`, so a bare host is not
refused for what the next stage will set. `preflight_warnings()` returns the lines that do not
refuse a host: CPUs, RAM and /dev/shm below the sizes seed 003 §2.1 starts from, and a disk
check that could not be sized.

Example:
    >>> expect = HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8)
    >>> preflight_problems({"gpu": {"status": "ok", "count": 7, "gpus": []}}, expect)[0]
    'h20-a: gpu.count: expected 8, found 7'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.sizes import format_size
from hgxserve.runtime.image_check import ImageCheck, image_checks

# a mismatch: (fact, expected, found)
_Report = Callable[[str, str, str], None]

GiB = 1 << 30
# Seed 003 §2.1, the starting point for an 8-GPU engine host: 64-128 CPUs, 320-512 GiB of RAM,
# and at least 64-128 GiB of /dev/shm (tmpfs, so its pages come out of that RAM).
SEED_CPUS = (64, 128)
SEED_RAM_BYTES = (320 * GiB, 512 * GiB)
SEED_SHM_BYTES = (64 * GiB, 128 * GiB)


@dataclass(frozen=True)
class HostExpectation:
    """What one host must look like for its part of the topology.

    Example:
        >>> HostExpectation(host="h200-a", gpu_kind="H200", gpu_count=8, shm_bytes=2**37).shm_bytes
        137438953472
    """

    host: str
    gpu_kind: str
    gpu_count: int
    used_gpus: tuple[int, ...] = ()
    rdma_devices: tuple[str, ...] = ()
    needs_peermem: bool = False
    shm_bytes: int | None = None
    model_path: str | None = None
    model_size_bytes: int | None = None
    # where model_size_bytes came from when not the topology's model.size (a manifest), or why
    # it is unknown when model_size_bytes is None
    model_size_from: str | None = None
    model_manifest: str | None = None  # the manifest's file name next to the model
    model_copied: bool = True  # False: the weights are read in place (CephFS without stage)
    driver_version: str | None = None
    memlock_infinity: bool = True
    # container images whose engines need the host's HCAs or kernel packages inside the
    # container (hgxserve.runtime.image_check): preflight runs each once and looks
    image_checks: tuple[ImageCheck, ...] = ()
    notes: tuple[str, ...] = field(default=())


def gpu_kind_of(name: str | None) -> str:
    """The product token of an nvidia-smi GPU name (`NVIDIA H20-3e` -> `H20-3e`).

    Example:
        >>> gpu_kind_of("NVIDIA H100 80GB HBM3")
        'H100'
    """
    words = (name or "").split()
    if words and words[0].upper() == "NVIDIA":
        words = words[1:]
    return words[0] if words else ""


def _ranges(indices: list[int]) -> str:
    return ",".join(str(i) for i in sorted(indices))


def preflight_problems(
    facts: dict[str, Any], expect: HostExpectation, after_provision: bool = True
) -> list[str]:
    """Every mismatch between `facts` and `expect`, as `HOST: FACT: expected X, found Y`.

    + facts: HOST_FACTS name -> value (missing names are skipped)
    + expect: what the topology asks of this host
    + after_provision: also check what the provision stage sets (shm, memlock, peermem, FM)

    Example:
        >>> preflight_problems({"peermem": False}, HostExpectation("a", "H20", 8,
        ...     needs_peermem=True))
        ['a: peermem: expected nvidia_peermem loaded (cross-host KV over RDMA), found not loaded']
    """
    host = expect.host
    problems: list[str] = []

    def problem(fact: str, expected: str, found: str) -> None:
        problems.append(f"{host}: {fact}: expected {expected}, found {found}")

    _gpu_facts(facts, expect, after_provision, problem)
    _rdma_facts(facts, expect, problem)
    if after_provision:
        _provisioned_facts(facts, expect, problem)
    _disk_facts(facts, expect, problem)
    _shm_fits_ram(facts, expect, problem)
    return problems


def preflight_warnings(facts: dict[str, Any], expect: HostExpectation) -> list[str]:
    """What does not refuse the host but an operator should see, as
    `HOST: FACT: expected X, found Y` (CPUs, RAM, /dev/shm below seed 003 §2.1's figures) or
    `HOST: disk: ...` when the model's size is unknown.

    Example:
        >>> preflight_warnings({"resources": {"cpus": 32, "mem_total_bytes": None}},
        ...     HostExpectation("a", "H20", 8))
        ['a: cpus: expected >= 64 (seed 003 §2.1: 64-128 CPUs per 8-GPU host), found 32']
    """
    host = expect.host
    warnings: list[str] = []

    def warning(fact: str, expected: str, found: str) -> None:
        warnings.append(f"{host}: {fact}: expected {expected}, found {found}")

    _sizing_warnings(facts, expect, warning)
    unsized = expect.model_copied and expect.model_path and not expect.model_size_bytes
    if facts.get("disk") is not None and unsized:
        why = f" ({expect.model_size_from})" if expect.model_size_from else ""
        warnings.append(
            f"{host}: disk: free space for {expect.model_path} not checked: no "
            f"model.size in the topology and no weights manifest to size it from{why}"
        )
    return warnings


def _shm_bytes(facts: dict[str, Any], expect: HostExpectation) -> int | None:
    """The /dev/shm the host will have: the topology's, else the one mounted now."""
    return expect.shm_bytes or (facts.get("shm") or {}).get("size_bytes")


def _shm_fits_ram(facts: dict[str, Any], expect: HostExpectation, problem: _Report) -> None:
    """A /dev/shm as large as RAM cannot be filled: tmpfs pages are RAM (seed 003 §2.1)."""
    ram = (facts.get("resources") or {}).get("mem_total_bytes")
    if ram and expect.shm_bytes and expect.shm_bytes >= ram:
        problem(
            "shm.size",
            f"less than the host's RAM (the topology's /dev/shm {format_size(expect.shm_bytes)} "
            "is tmpfs, taken from RAM)",
            f"{_human(ram)} RAM",
        )


def _sizing_warnings(facts: dict[str, Any], expect: HostExpectation, warning: _Report) -> None:
    resources = facts.get("resources") or {}
    cpus, ram = resources.get("cpus"), resources.get("mem_total_bytes")
    if cpus is not None and cpus < SEED_CPUS[0]:
        warning("cpus", f">= {SEED_CPUS[0]} (seed 003 §2.1: 64-128 CPUs per 8-GPU host)", str(cpus))
    shm = _shm_bytes(facts, expect) or 0
    if ram is not None and ram < SEED_RAM_BYTES[0] + shm:
        also = f" + the {format_size(shm)} of /dev/shm that tmpfs takes from it" if shm else ""
        warning(
            "memory",
            f">= {_human(SEED_RAM_BYTES[0] + shm)} RAM (seed 003 §2.1: 320-512 GiB for the "
            f"engines{also})",
            f"{_human(ram)}",
        )
    if expect.shm_bytes and expect.shm_bytes < SEED_SHM_BYTES[0]:
        warning(
            "shm.size",
            f">= {format_size(SEED_SHM_BYTES[0])} (seed 003 §2.1: 64-128 GiB of /dev/shm)",
            f"{format_size(expect.shm_bytes)} in the topology",
        )


def _gpu_facts(
    facts: dict[str, Any], expect: HostExpectation, after_provision: bool, problem: _Report
) -> None:
    gpu = facts.get("gpu")
    if gpu is None:
        return
    status = gpu.get("status")
    if status == "ok":
        _gpu_problems(gpu, expect, problem)
        if after_provision:
            _fabric_manager(facts, gpu.get("driver_version"), problem)
    # Before provisioning, a host without a working driver is what provision fixes.
    elif after_provision or status == "error":
        detail = f": {gpu.get('error')}" if gpu.get("error") else ""
        problem(
            "gpu",
            f"{expect.gpu_count} x {expect.gpu_kind} visible to nvidia-smi",
            f"nvidia-smi {status}{detail}",
        )


def _fabric_manager(facts: dict[str, Any], driver: str | None, problem: _Report) -> None:
    fm_needed = (facts.get("nvswitch") or {}).get("present")
    fm = facts.get("fabric_manager")
    if not fm_needed or fm is None:
        return
    if fm.get("version") != driver:
        problem(
            "fabric_manager.version",
            f"{driver} (the driver's; NVSwitch present)",
            fm.get("version") or "not installed",
        )
    if fm.get("active") != "active":
        problem("fabric_manager.active", "active", str(fm.get("active")))


def _rdma_facts(facts: dict[str, Any], expect: HostExpectation, problem: _Report) -> None:
    rdma = facts.get("rdma")
    if rdma is None:
        return
    devices = rdma.get("devices", {})
    for name in expect.rdma_devices:
        device = devices.get(name)
        if device is None:
            listed = ", ".join(sorted(devices)) or "no RDMA devices"
            problem(f"rdma.{name}", "device present", f"missing (host has {listed})")
            continue
        states = {port: info.get("state") for port, info in device.get("ports", {}).items()}
        if "PORT_ACTIVE" not in states.values():
            found = ", ".join(f"port {p} {s}" for p, s in sorted(states.items())) or "no ports"
            problem(f"rdma.{name}", "PORT_ACTIVE", found)


def _provisioned_facts(facts: dict[str, Any], expect: HostExpectation, problem: _Report) -> None:
    """What the provision stage sets: peermem, /dev/shm, the memlock limit."""
    if expect.needs_peermem and "peermem" in facts and not facts["peermem"]:
        problem("peermem", "nvidia_peermem loaded (cross-host KV over RDMA)", "not loaded")
    shm = facts.get("shm")
    if shm is not None and expect.shm_bytes:
        size = shm.get("size_bytes")
        if size is None or size < expect.shm_bytes:
            problem(
                "shm.size",
                f">= {format_size(expect.shm_bytes)}",
                format_size(size) if size is not None else "no /dev/shm",
            )
    memlock = facts.get("memlock")
    if memlock is not None and expect.memlock_infinity and not memlock.get("infinity"):
        problem(
            "memlock",
            "infinity for systemd units",
            f"DefaultLimitMEMLOCK={memlock.get('default')}, unit ulimit -l={memlock.get('unit')}",
        )


def _disk_facts(facts: dict[str, Any], expect: HostExpectation, problem: _Report) -> None:
    disk = facts.get("disk")
    if disk is None or not expect.model_copied or not expect.model_size_bytes:
        return
    avail = disk.get("avail_bytes")
    needed = max(expect.model_size_bytes - int(disk.get("present_bytes") or 0), 0)
    if avail is None or avail < needed:
        sized = f" (size from {expect.model_size_from})" if expect.model_size_from else ""
        problem(
            "disk",
            f">= {_human(needed)} free on {disk.get('mount') or '?'} for "
            f"{expect.model_path or 'the model'}{sized}",
            f"{_human(avail)} free" if avail is not None else "no filesystem",
        )


def _human(size: int | None) -> str:
    if size is None:
        return "?"
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
        if size >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{size} B"


def _gpu_problems(gpu: dict[str, Any], expect: HostExpectation, problem: _Report) -> None:
    gpus = gpu.get("gpus") or []
    count = gpu.get("count", len(gpus))
    if count != expect.gpu_count:
        problem("gpu.count", str(expect.gpu_count), str(count))
    wrong: dict[str, list[int]] = {}
    for entry in gpus:
        if gpu_kind_of(entry.get("name")).lower() != expect.gpu_kind.lower():
            wrong.setdefault(str(entry.get("name")), []).append(entry.get("index"))
    for name, indices in sorted(wrong.items()):
        problem("gpu.name", f"{expect.gpu_kind} on every GPU", f"{name} on GPU {_ranges(indices)}")
    present = {entry.get("index") for entry in gpus}
    missing = [i for i in expect.used_gpus if i not in present]
    if missing and count == expect.gpu_count:
        problem(
            "gpu.index", f"GPUs {_ranges(list(expect.used_gpus))}", f"no GPU {_ranges(missing)}"
        )
    mig = [
        entry.get("index")
        for entry in gpus
        if entry.get("index") in expect.used_gpus and entry.get("mig_mode") == "Enabled"
    ]
    if mig:
        problem("gpu.mig", f"MIG disabled on GPU {_ranges(mig)} (used by engines)", "Enabled")
    if expect.driver_version and gpu.get("driver_version") != expect.driver_version:
        problem("gpu.driver_version", expect.driver_version, str(gpu.get("driver_version")))


def expectation_from_topology(topo: Any, host_name: str) -> HostExpectation:
    """Build a host's HostExpectation from a loaded topology (hgxserve.topology.Topology).

    Peermem is needed when the host has RDMA devices and one of its engines either spans
    hosts or exchanges KV with an engine on another host (a proxy route across hosts).

    Example:
        expect = expectation_from_topology(load_topology("topologies/x.yml"), "h20-a")
    """
    host = topo.hosts[host_name]
    source = topo.model.source  # a CephFS source has `stage`; read in place without it
    engines = list(topo.engines.values())
    mine = [engine for engine in engines if host_name in engine.place]
    used = sorted({index for engine in mine for index in engine.place[host_name]})
    cross_host = any(engine.is_multi_node for engine in mine)
    proxy = getattr(topo, "proxy", None)
    by_name = topo.engines
    for route in getattr(proxy, "routes", ()) if proxy else ():
        members = [by_name[name] for name in (*route.prefill, *route.decode) if name in by_name]
        hosts = {h for engine in members for h in engine.place}
        if host_name in hosts and len(hosts) > 1 and any(e.kv for e in members):
            cross_host = True
    return HostExpectation(
        host=host_name,
        gpu_kind=host.gpu,
        gpu_count=host.gpus,
        used_gpus=tuple(used),
        rdma_devices=tuple(host.rdma),
        needs_peermem=bool(host.rdma) and cross_host,
        shm_bytes=host.shm,
        model_path=topo.model.path,
        model_size_bytes=topo.model.size,
        image_checks=tuple(image_checks(topo, host_name)),
        model_manifest=topo.model.manifest,
        model_copied=not (hasattr(source, "stage") and not source.stage),
    )
