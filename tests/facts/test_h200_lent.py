"""Parsers, facts and unit-side GPU checks against outputs captured on a real H200.

The captures under tests/fixtures/h200-lent/ came from one lent single-GPU H200 VM (driver
580.159.04, CUDA 13.0, torch 2.11.0+cu130) through scripts/device/run_h200.sh and run_gpus.sh:
`facts.txt` is what every fact's own command printed there (scripts/device/facts_script.py),
so each fact's `process()` is checked on the lines a real host gave it. Every value asserted is
the one printed in the capture.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import FactBase

from hgxserve.facts.caches import CacheKeyFacts
from hgxserve.facts.gpu import GpuInventory, NvidiaKernelModule
from hgxserve.facts.host import RdmaDevices, UnitMemlock
from hgxserve.facts.runtime import DriverCuda, VenvRuntimeState
from hgxserve.gpus import checks as gpus
from hgxserve.parsers import outputs as parsers
from hgxserve.runtime.checks import runtime_problems
from hgxserve.runtime.spec import VenvRuntime

LENT = Path(__file__).resolve().parents[1] / "fixtures" / "h200-lent"
UUID = "GPU-00000000-0000-0000-0000-000000000001"


def lent(name: str) -> str:
    first, _, rest = (LENT / name).read_text().partition("\n")
    assert first.startswith("# source:"), f"{name}: missing source header"
    return rest


def fact_lines() -> dict[str, list[str]]:
    """facts.txt split into each fact's output lines (`#### NAME` ... `#### rc N`)."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lent("facts.txt").splitlines():
        if line.startswith("#### rc "):
            current = None
        elif line.startswith("#### "):
            current = blocks.setdefault(line[5:], [])
        elif current is not None:
            current.append(line)
    return blocks


def processed(name: str, cls: type[FactBase]) -> Any:
    return cls().process(fact_lines()[name])


def test_topo_header_with_terminal_codes_is_parsed():
    # nvidia-smi 580 underlines the header (ESC[4m ... ESC[0m) even into a file.
    text = lent("topo-m.txt")
    assert "\x1b[4m" in text
    topo = parsers.parse_topo_matrix(text)
    assert topo["devices"] == ["GPU0"]
    assert topo["links"] == {"GPU0": {"GPU0": "X"}}
    assert topo["cpu_affinity"] == {"GPU0": "0-15"}
    assert topo["numa_affinity"] == {"GPU0": "0"}
    assert topo["nvlinks"] == {"GPU0": {}}


def test_terminal_codes_are_stripped_from_every_smi_parser():
    table = lent("nvidia-smi.txt")
    coloured = "\x1b[1m" + table.replace("NVIDIA H200", "\x1b[4mNVIDIA H200\x1b[0m")
    assert parsers.parse_smi_table(coloured) == parsers.parse_smi_table(table)


def test_smi_table_580_with_a_process():
    table = parsers.parse_smi_table(lent("nvidia-smi_with-process.txt"))
    assert (table["driver_version"], table["cuda_version"]) == ("580.159.04", "13.0")
    [gpu] = table["gpus"]
    assert (gpu["name"], gpu["memory_used_mib"], gpu["memory_total_mib"]) == (
        "NVIDIA H200",
        21099,
        143771,
    )
    assert gpu["persistence_mode"] is True and gpu["mig_mode"] == "Disabled"
    assert table["processes"] == [
        {
            "gpu": 0,
            "gi": "N/A",
            "ci": "N/A",
            "pid": 483,
            "type": "C",
            "name": "python3",
            "used_memory": "21090MiB",
            "used_memory_mib": 21090,
        }
    ]


def test_smi_list_and_query_580():
    assert parsers.parse_smi_list(lent("nvidia-smi-L.txt")) == [
        {"index": 0, "name": "NVIDIA H200", "uuid": UUID, "mig_devices": []}
    ]
    report = parsers.parse_smi_query(lent("nvidia-smi-q.txt"))
    assert (report["driver_version"], report["cuda_version"], report["attached_gpus"]) == (
        "580.159.04",
        "13.0",
        1,
    )
    [gpu] = report["gpus"]
    assert (gpu["memory_total_mib"], gpu["memory_reserved_mib"]) == (143771, 616)
    # A pass-through single GPU has no NVSwitch fabric: the 580 layout reports N/A there.
    assert (gpu["fabric_state"], gpu["fabric_status"]) == ("N/A", "N/A")
    assert gpu["Product Architecture"] == "Hopper"


def test_compute_apps_with_and_without_header():
    # `--format=csv` (header and units) and `csv,noheader,nounits` (what gpus.checks asks for)
    assert parsers.parse_smi_csv(lent("query-compute-apps.txt"), ("pid", "used_memory")) == [
        {"pid": 483, "used_memory": 21090}
    ]
    assert parsers.parse_smi_csv(lent("query-compute-apps_idle.txt"), ("pid", "used_memory")) == []
    assert parsers.parse_compute_apps(lent("query-compute-apps_gpus-busy.txt")) == [
        {"gpu_uuid": UUID, "pid": 453, "used_memory_mib": 41570}
    ]


def test_gpu_facts_from_the_real_host():
    inventory = processed("GpuInventory", GpuInventory)
    assert (inventory["status"], inventory["count"], inventory["driver_version"]) == (
        "ok",
        1,
        "580.159.04",
    )
    assert inventory["gpus"][0]["memory_total_mib"] == 143771
    assert processed("DriverCuda", DriverCuda) == {
        "status": "ok",
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
    }
    assert processed("NvidiaKernelModule", NvidiaKernelModule)["loaded"] == "580.159.04"
    # No RDMA tools and no systemctl on that machine: the facts say so instead of failing.
    assert processed("RdmaDevices", RdmaDevices) == {"devices": {}, "ibv_devinfo": "absent"}
    assert processed("UnitMemlock", UnitMemlock)["default"] is None


def test_runtime_fact_reads_torch_cuda_of_a_real_venv():
    state = processed("VenvRuntimeState", VenvRuntimeState)
    assert state["present"] is True
    assert (state["torch_version"], state["torch_cuda"]) == ("2.11.0", "13.0")
    assert state["imports"]["torch"] == "ok"
    assert state["imports"]["nixl._api"].startswith("ModuleNotFoundError")


def test_preflight_lines_on_the_real_host():
    state = processed("VenvRuntimeState", VenvRuntimeState)
    driver = processed("DriverCuda", DriverCuda)
    venv = "/opt/torch/.venv"
    spec = VenvRuntime(venv=venv, engine="vllm", version=None, imports=("nixl._api",))
    problems = runtime_problems("h200", [spec], {venv: state}, driver)
    # torch cu130 on driver 580 (CUDA 13.0) pairs; the missing NIXL is named, nothing else.
    assert len(problems) == 1, problems
    assert problems[0].startswith("h200: runtime.nixl: expected nixl._api importable in")
    assert "No module named 'nixl'" in problems[0]
    # The same torch on the 570 driver hgxserve installs by default is refused before any change.
    old = {"status": "ok", "driver_version": "570.158.01", "cuda_version": "12.8"}
    [line] = runtime_problems("h200", [VenvRuntime(venv, "vllm", None)], {venv: state}, old)
    assert line.startswith("h200: runtime.cuda: expected CUDA <= 12.8 (driver 570.158.01)")
    assert "found torch 2.11.0 built for CUDA 13.0" in line and "580" in line


def test_cache_key_facts_of_a_real_h200():
    assert processed("CacheKeyFacts", CacheKeyFacts) == {
        "compute_capability": "9.0",
        "cuda_version": "13.0",
        "driver_version": "580.159.04",
        "gpu_name": "NVIDIA H200",
        "sm_count": 132,
        "torch_version": "2.11.0+cu130",
    }


def test_check_free_message_matches_the_real_run(monkeypatch: pytest.MonkeyPatch):
    answers = {
        "--query-gpu=index,uuid": lent("query-gpu_index-uuid.txt"),
        "--query-compute-apps=gpu_uuid,pid,used_memory": lent("query-compute-apps_gpus-busy.txt"),
    }
    monkeypatch.setattr(gpus, "_run", lambda argv: answers[argv[1]])
    busy = gpus.busy_processes([0])
    printed = gpus.describe(busy)
    real = lent("hgxserve-gpus-checks.txt")
    assert printed == [f"GPU 0 ({UUID}) is busy: pid 453 uses 41570 MiB"]
    assert printed[0] in real
    # What the real run measured: each check's exit status, and memory freed within a second.
    assert re.search(r"## check-free busy\n.*\n.*\n## rc 1", real)
    freed = [
        float(seconds)
        for seconds in re.findall(
            r"after SIG(?:TERM|KILL)\n.*\n(?:.*Killed.*\n)?## rc 0 after ([0-9.]+) s", real
        )
    ]
    assert len(freed) == 2 and max(freed) < 1.0
