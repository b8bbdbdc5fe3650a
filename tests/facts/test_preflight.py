"""Preflight: facts (from real captures where they exist) compared with a host's expectation."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hgxserve.facts.preflight import (
    HostExpectation,
    gpu_kind_of,
    preflight_problems,
    preflight_warnings,
)
from hgxserve.parsers import outputs as parsers
from hgxserve.parsers.probes import gpu_inventory_from_sections

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3


def inventory_from_table(text: str, listing: str = "") -> dict:
    """GpuInventory value for a host whose nvidia-smi prints `text` (and `listing` for -L)."""
    return gpu_inventory_from_sections(
        {
            "query": {"lines": ["Invalid combination of input arguments"], "rc": 2},
            "table": {"lines": text.splitlines(), "rc": 0},
            "list": {"lines": listing.splitlines(), "rc": 0},
        }
    )


def rdma_from_ibv(text: str) -> dict:
    devices = {}
    for hca in parsers.parse_ibv_devinfo(text):
        devices[hca["hca_id"]] = {
            "ports": {str(p["port"]): {"state": p["state"]} for p in hca["ports"]}
        }
    return {"devices": devices, "ibv_devinfo": "ok"}


def healthy_facts(capture) -> dict:
    return {
        "gpu": inventory_from_table(capture("h200_nvidia-smi.txt")),
        "nvswitch": {"present": True, "proc_devices": 4, "pci_bridges": 4},
        "fabric_manager": {"version": "570.158.01", "active": "active", "enabled": "enabled"},
        "rdma": rdma_from_ibv(capture("h200_ibv_devinfo.txt")),
        "peermem": True,
        "shm": {"fstype": "tmpfs", "size_bytes": 128 * GiB, "avail_bytes": 128 * GiB},
        "memlock": {"default": "infinity", "unit": "unlimited", "infinity": True},
        "disk": {"mount": "/models", "avail_bytes": 900 * GiB, "size_bytes": 3500 * GiB,
                 "present_bytes": 0},
        # an H200 host as seed 003 §2.1 sizes one, or larger: 2 TiB of RAM, 192 CPUs
        "resources": {"cpus": 192, "mem_total_bytes": 2063 * GiB},
    }  # fmt: skip


H200 = HostExpectation(
    host="h200-a",
    gpu_kind="H200",
    gpu_count=8,
    used_gpus=tuple(range(8)),
    rdma_devices=("mlx5_0", "mlx5_1", "mlx5_10"),
    needs_peermem=True,
    shm_bytes=128 * GiB,
    model_path="/models/DeepSeek-V3.2",
    model_size_bytes=690 * GiB,
)


def test_healthy_h200_host_passes(capture):
    assert preflight_problems(healthy_facts(capture), H200) == []
    assert preflight_warnings(healthy_facts(capture), H200) == []


def test_cpus_ram_and_shm_below_the_seed_figures_warn(capture):
    facts = healthy_facts(capture)
    facts["resources"] = {"cpus": 48, "mem_total_bytes": 384 * GiB}
    small_shm = HostExpectation(host="h200-a", gpu_kind="H200", gpu_count=8, shm_bytes=32 * GiB)
    assert preflight_warnings(facts, small_shm) == [
        "h200-a: cpus: expected >= 64 (seed 003 §2.1: 64-128 CPUs per 8-GPU host), found 48",
        "h200-a: shm.size: expected >= 64Gi (seed 003 §2.1: 64-128 GiB of /dev/shm), found "
        "32Gi in the topology",
    ]
    # 384 GiB holds the seed's 320 GiB, but not with a 128 GiB /dev/shm on top
    assert preflight_warnings(facts, H200)[1:] == [
        "h200-a: memory: expected >= 448.0 GiB RAM (seed 003 §2.1: 320-512 GiB for the engines "
        "+ the 128Gi of /dev/shm that tmpfs takes from it), found 384.0 GiB",
    ]
    # Warnings never refuse the host.
    assert preflight_problems(facts, H200) == []


def test_shm_as_large_as_ram_cannot_fit(capture):
    facts = healthy_facts(capture)
    facts["resources"] = {"cpus": 192, "mem_total_bytes": 125 * GiB}
    problem = (
        "h200-a: shm.size: expected less than the host's RAM (the topology's /dev/shm 128Gi is "
        "tmpfs, taken from RAM), found 125.0 GiB RAM"
    )
    assert preflight_problems(facts, H200) == [problem]
    # Provisioning cannot fix the host's RAM: the check stands before it too.
    assert preflight_problems(facts, H200, after_provision=False) == [problem]
    facts["resources"]["mem_total_bytes"] = 129 * GiB
    assert preflight_problems(facts, H200) == []


def test_disk_sized_from_a_manifest(capture):
    facts = healthy_facts(capture)
    facts["disk"]["avail_bytes"] = 600 * GiB
    where = "the published manifest s3://models/DeepSeek-V3.2/hgxserve-manifest.json"
    sized = HostExpectation(
        host="h200-a", gpu_kind="H200", gpu_count=8, model_path="/models/DeepSeek-V3.2",
        model_size_bytes=690 * GiB, model_size_from=where,
    )  # fmt: skip
    assert preflight_problems(facts, sized) == [
        "h200-a: disk: expected >= 690.0 GiB free on /models for /models/DeepSeek-V3.2 (size "
        f"from {where}), found 600.0 GiB free"
    ]
    facts["disk"]["avail_bytes"] = 700 * GiB
    assert preflight_problems(facts, sized) == []


def test_disk_without_a_size_says_so(capture):
    facts = healthy_facts(capture)
    facts["disk"]["avail_bytes"] = 1 * GiB
    why = "the published manifest s3://m/x/hgxserve-manifest.json could not be read"
    unsized = HostExpectation(
        host="h200-a", gpu_kind="H200", gpu_count=8, model_path="/models/x", model_size_from=why
    )
    assert preflight_problems(facts, unsized) == []
    assert preflight_warnings(facts, unsized) == [
        "h200-a: disk: free space for /models/x not checked: no model.size in the topology and "
        f"no weights manifest to size it from ({why})"
    ]
    # Weights read in place (CephFS without stage) need no room: no line at all.
    in_place = HostExpectation(
        host="h200-a", gpu_kind="H200", gpu_count=8, model_path="/models/x", model_copied=False
    )
    assert preflight_warnings(facts, in_place) == []


def test_seven_gpus(capture):
    facts = healthy_facts(capture)
    facts["gpu"]["gpus"] = facts["gpu"]["gpus"][:7]
    facts["gpu"]["count"] = 7
    assert preflight_problems(facts, H200) == ["h200-a: gpu.count: expected 8, found 7"]


def test_wrong_gpu_kind_h20_3e(capture):
    facts = healthy_facts(capture)
    facts["gpu"] = inventory_from_table(capture("h20-3e_nvidia-smi.txt"))
    assert preflight_problems(facts, H200) == [
        "h200-a: gpu.name: expected H200 on every GPU, found NVIDIA H20-3e on GPU 0,1,2,3,4,5,6,7",
        # That capture's driver is 550.144.03, so FM 570.158.01 is a mismatch as well.
        "h200-a: fabric_manager.version: expected 550.144.03 (the driver's; NVSwitch present), "
        "found 570.158.01",
    ]


def test_fabric_manager_version_differs(capture):
    facts = healthy_facts(capture)
    facts["fabric_manager"] = {"version": "570.133.20", "active": "failed"}
    assert preflight_problems(facts, H200) == [
        "h200-a: fabric_manager.version: expected 570.158.01 (the driver's; NVSwitch present), "
        "found 570.133.20",
        "h200-a: fabric_manager.active: expected active, found failed",
    ]


def test_fabric_manager_missing_only_matters_with_nvswitch(capture):
    facts = healthy_facts(capture)
    facts["fabric_manager"] = {"version": None, "active": "inactive"}
    assert preflight_problems(facts, H200)[0] == (
        "h200-a: fabric_manager.version: expected 570.158.01 (the driver's; NVSwitch present), "
        "found not installed"
    )
    facts["nvswitch"] = {"present": False}
    assert preflight_problems(facts, H200) == []


def test_mig_on_used_gpus(capture):
    facts = healthy_facts(capture)
    facts["gpu"] = inventory_from_table(
        capture("h20_nvidia-smi_mig.txt"), capture("h20_nvidia-smi-L_mig.txt")
    )
    expect = HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8, used_gpus=(0, 1, 2, 3))
    assert preflight_problems(facts, expect) == [
        "h20-a: gpu.mig: expected MIG disabled on GPU 0,1,2 (used by engines), found Enabled"
    ]
    unused = HostExpectation(host="h20-a", gpu_kind="H20", gpu_count=8, used_gpus=(4, 5, 6, 7))
    assert preflight_problems(facts, unused) == []


def test_rdma_port_down_and_missing(capture):
    facts = healthy_facts(capture)
    facts["rdma"]["devices"]["mlx5_1"]["ports"]["1"]["state"] = "PORT_DOWN"
    expect = HostExpectation(
        host="h200-a", gpu_kind="H200", gpu_count=8, rdma_devices=("mlx5_1", "mlx5_9")
    )
    problems = preflight_problems(facts, expect)
    assert problems[0] == "h200-a: rdma.mlx5_1: expected PORT_ACTIVE, found port 1 PORT_DOWN"
    assert problems[1].startswith(
        "h200-a: rdma.mlx5_9: expected device present, found missing (host has mlx5_0, mlx5_1,"
    )
    assert len(problems) == 2


def test_provisioned_state_checks(capture):
    facts = healthy_facts(capture)
    facts["peermem"] = False
    facts["shm"]["size_bytes"] = 64 * GiB
    facts["memlock"] = {"default": "8388608", "unit": "8192", "infinity": False}
    facts["disk"]["avail_bytes"] = 100 * GiB
    facts["disk"]["present_bytes"] = 500 * GiB
    assert preflight_problems(facts, H200) == [
        "h200-a: peermem: expected nvidia_peermem loaded (cross-host KV over RDMA), "
        "found not loaded",
        "h200-a: shm.size: expected >= 128Gi, found 64Gi",
        "h200-a: memlock: expected infinity for systemd units, found "
        "DefaultLimitMEMLOCK=8388608, unit ulimit -l=8192",
        "h200-a: disk: expected >= 190.0 GiB free on /models for /models/DeepSeek-V3.2, "
        "found 100.0 GiB free",
    ]
    # Before provisioning only what provisioning cannot fix counts.
    assert preflight_problems(facts, H200, after_provision=False) == [
        "h200-a: disk: expected >= 190.0 GiB free on /models for /models/DeepSeek-V3.2, "
        "found 100.0 GiB free",
    ]


def test_no_driver_yet(capture):
    facts = healthy_facts(capture)
    facts["gpu"] = {"status": "absent", "count": 0, "gpus": [], "error": None}
    assert preflight_problems(facts, H200, after_provision=False) == []
    assert preflight_problems(facts, H200) == [
        "h200-a: gpu: expected 8 x H200 visible to nvidia-smi, found nvidia-smi absent"
    ]


@pytest.mark.parametrize(
    ("name", "kind"),
    [("NVIDIA H20", "H20"), ("NVIDIA H20-3e", "H20-3e"), ("NVIDIA H100 80GB HBM3", "H100")],
)
def test_gpu_kind_of(name, kind):
    assert gpu_kind_of(name) == kind


def _harness():
    spec = importlib.util.spec_from_file_location(
        "hgx_op_harness", REPO / "tests/test_operations.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["hgx_op_harness"] = module
    spec.loader.exec_module(module)
    return module


def _fact_table(facts: dict, model_path: str) -> dict:
    names = {
        "gpu": "hgxserve.facts.gpu.GpuInventory",
        "nvswitch": "hgxserve.facts.gpu.NvSwitchPresent",
        "fabric_manager": "hgxserve.facts.gpu.FabricManagerState",
        "kernel_module": "hgxserve.facts.gpu.NvidiaKernelModule",
        "rdma": "hgxserve.facts.host.RdmaDevices",
        "peermem": "hgxserve.facts.host.PeermemLoaded",
        "shm": "hgxserve.facts.host.ShmSize",
        "memlock": "hgxserve.facts.host.UnitMemlock",
        "os": "hgxserve.facts.host.OsRelease",
        "held_packages": "hgxserve.facts.host.HeldPackages",
    }
    names["resources"] = "hgxserve.facts.host.HostResources"
    table = {names[key]: value for key, value in facts.items() if key in names}
    table["hgxserve.facts.host.DiskFree"] = {f"path={model_path}": facts["disk"]}
    table.setdefault(names["kernel_module"], {"loaded": None})
    table.setdefault(names["os"], {"ID": "debian"})
    table.setdefault(names["held_packages"], [])
    table.setdefault(
        "hgxserve.facts.runtime.HostPython",
        facts.get("python", {"version": "3.11", "machine": "x86_64", "glibc": "2.36"}),
    )
    return table


def test_preflight_role_raises_before_any_operation(capture):
    harness = _harness()
    from roles.preflight import preflight

    facts = healthy_facts(capture)
    facts["gpu"]["gpus"] = facts["gpu"]["gpus"][:7]
    facts["gpu"]["count"] = 7
    facts["fabric_manager"]["version"] = "570.133.20"
    with pytest.raises(Exception) as raised:
        harness.run_deploy(preflight, {"expect": H200}, _fact_table(facts, H200.model_path))
    assert type(raised.value).__name__ == "DeployError"
    assert str(raised.value) == (
        "preflight failed on h200-a (2 problems):\n"
        "  h200-a: gpu.count: expected 8, found 7\n"
        "  h200-a: fabric_manager.version: expected 570.158.01 (the driver's; NVSwitch present), "
        "found 570.133.20"
    )
    assert (
        harness.run_deploy(
            preflight, {"expect": H200}, _fact_table(healthy_facts(capture), H200.model_path)
        )
        == []
    )


def test_a_python_the_agent_cannot_run_on_is_one_line(capture):
    """The agent is a venv of the host's python3, 3.10 to 3.13: outside, preflight names it."""
    harness = _harness()
    from roles.preflight import preflight

    facts = healthy_facts(capture)
    facts["python"] = {"version": "3.9", "machine": "x86_64", "glibc": "2.31"}
    with pytest.raises(Exception) as raised:
        harness.run_deploy(preflight, {"expect": H200}, _fact_table(facts, H200.model_path))
    assert str(raised.value) == (
        "preflight failed on h200-a (1 problem):\n"
        "  h200-a: python3: expected Python 3.10 to 3.13 for the hgxserve agent, found Python 3.9"
    )
    for version in ("3.10", "3.12", "3.13"):
        facts["python"] = {"version": version, "machine": "x86_64", "glibc": "2.35"}
        table = _fact_table(facts, H200.model_path)
        assert harness.run_deploy(preflight, {"expect": H200}, table) == []


def test_role_sizes_the_disk_check_from_the_manifest_on_the_host(capture):
    harness = _harness()
    from roles.preflight import preflight

    unsized = HostExpectation(
        host="h200-a", gpu_kind="H200", gpu_count=8, used_gpus=tuple(range(8)),
        model_path="/models/DeepSeek-V3.2", model_manifest="hgxserve-manifest.json",
    )  # fmt: skip
    facts = healthy_facts(capture)
    facts["disk"]["avail_bytes"] = 600 * GiB
    table = _fact_table(facts, unsized.model_path)
    key = "dest=/models/DeepSeek-V3.2, manifest=hgxserve-manifest.json"
    on_host = "/models/DeepSeek-V3.2/.hgxserve/manifest.json"
    table["hgxserve.facts.weights.ManifestSize"] = {
        key: {"bytes": 690 * GiB, "files": 163, "file": on_host}
    }
    with pytest.raises(Exception) as raised:
        harness.run_deploy(preflight, {"expect": unsized}, table)
    assert str(raised.value).endswith(
        "h200-a: disk: expected >= 690.0 GiB free on /models for /models/DeepSeek-V3.2 (size "
        f"from the manifest on the host, {on_host}), found 600.0 GiB free"
    )
    # No manifest anywhere: the host passes, and the warning says the check was not sized.
    table["hgxserve.facts.weights.ManifestSize"] = {key: {"bytes": None, "files": 0, "file": None}}
    assert harness.run_deploy(preflight, {"expect": unsized}, table) == []


def test_manifest_size_fact_reads_the_state_copy(tmp_path):
    from hgxserve.facts.weights import ManifestSize, manifest_size

    fact = ManifestSize()
    command = fact.command(dest=str(tmp_path), manifest="hgxserve-manifest.json")

    def run() -> dict:
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
        return fact.process(out.stdout.splitlines())

    assert run() == {"bytes": None, "files": 0, "file": None}
    state = tmp_path / ".hgxserve"
    state.mkdir()
    files = [{"path": "a.safetensors", "size": 5 * GiB}, {"path": "config.json", "size": 812}]
    (state / "manifest.json").write_text(json.dumps({"schema": "x", "files": files}))
    assert run() == {"bytes": 5 * GiB + 812, "files": 2, "file": str(state / "manifest.json")}
    # The tree's own manifest comes first; an unreadable one counts as none.
    (tmp_path / "hgxserve-manifest.json").write_text("{not json")
    assert run() == {"bytes": None, "files": 0, "file": None}
    assert (
        manifest_size(["##manifest /x", '{"files": [{"path": "a", "size": -1}]}'])["bytes"] is None
    )
