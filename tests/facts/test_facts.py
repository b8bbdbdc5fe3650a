"""pyinfra facts: command() run by a real shell against tools printing real captures; process()."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hgxserve.facts import HOST_FACTS
from hgxserve.facts.gpu import (
    FabricManagerState,
    GpuInventory,
    NvidiaKernelModule,
    NvSwitchPresent,
)
from hgxserve.facts.host import (
    DiskFree,
    HeldPackages,
    HostResources,
    OsRelease,
    PeermemLoaded,
    RdmaDevices,
    ShmSize,
    UnitMemlock,
)
from hgxserve.parsers.probes import upstream_version

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"  # copied from shared/


def run_fact(fact, path_dirs, **kwargs):
    """Run a fact's command in sh with PATH limited to `path_dirs` + coreutils; process it."""
    env = {"PATH": ":".join([*map(str, path_dirs), "/usr/bin", "/bin"]), "LC_ALL": "C"}
    proc = subprocess.run(
        ["sh", "-c", str(fact.command(**kwargs))], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return fact.process(proc.stdout.splitlines())


def fake_tool(bindir: Path, name: str, script: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def capture_printer(fixture: str) -> str:
    return f"tail -n +2 {FIXTURES / fixture}\n"


@pytest.fixture
def bindir(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    return d


def test_every_fact_has_a_short_name():
    assert set(HOST_FACTS) == {
        "gpu", "nvswitch", "fabric_manager", "kernel_module", "rdma", "peermem", "shm",
        "memlock", "disk", "resources", "os", "held_packages",
    }  # fmt: skip


def test_gpu_inventory_absent_without_nvidia_smi(bindir):
    # Only our empty bin dir and /nonexistent: no nvidia-smi anywhere.
    fact = GpuInventory()
    proc = subprocess.run(
        ["/bin/sh", "-c", fact.command()],
        capture_output=True,
        text=True,
        env={"PATH": str(bindir)},
    )
    assert proc.returncode == 0
    assert fact.process(proc.stdout.splitlines()) == {
        "status": "absent", "count": 0, "driver_version": None, "gpus": [], "error": None,
    }  # fmt: skip


def test_gpu_inventory_from_query(bindir):
    fake_tool(
        bindir,
        "nvidia-smi",
        'case "$1" in --query-gpu=*) for i in 0 1 2 3 4 5 6; do '
        'echo "$i, NVIDIA H20, GPU-00000000-0000-0000-0000-00000000000$((i+1)), 97871, 0, '
        '570.158.01, Enabled, Disabled"; done;; *) exit 9;; esac\n',
    )
    inventory = run_fact(GpuInventory(), [bindir])
    assert inventory["status"] == "ok"
    assert inventory["count"] == 7
    assert inventory["driver_version"] == "570.158.01"
    assert inventory["gpus"][6] == {
        "index": 6,
        "name": "NVIDIA H20",
        "uuid": "GPU-00000000-0000-0000-0000-000000000007",
        "memory_total_mib": 97871,
        "memory_used_mib": 0,
        "persistence_mode": True,
        "mig_mode": "Disabled",
    }


def test_gpu_inventory_falls_back_to_table_and_list(capture, bindir):
    # An nvidia-smi that knows only the table and -L (what the real captures show).
    fake_tool(
        bindir,
        "nvidia-smi",
        'case "$1" in --query-gpu=*) echo "Invalid combination of input arguments"; exit 2;;\n'
        f"-L) {capture_printer('h20_nvidia-smi-L_mig.txt')};;\n"
        f'"") {capture_printer("h20_nvidia-smi_mig.txt")};; esac\n',
    )
    inventory = run_fact(GpuInventory(), [bindir])
    assert inventory["status"] == "ok"
    assert inventory["count"] == 8
    assert inventory["driver_version"] == "570.158.01"
    assert [gpu["mig_mode"] for gpu in inventory["gpus"]] == ["Enabled"] * 3 + ["Disabled"] * 5
    assert inventory["gpus"][7]["uuid"] == "GPU-00000000-0000-0000-0000-000000000008"
    assert inventory["gpus"][0]["memory_total_mib"] == 97871


def test_gpu_inventory_when_nvidia_smi_ignores_query(capture, bindir):
    fake_tool(bindir, "nvidia-smi", capture_printer("h200_nvidia-smi.txt"))
    inventory = run_fact(GpuInventory(), [bindir])
    assert inventory["status"] == "ok"
    assert inventory["count"] == 8
    assert {gpu["name"] for gpu in inventory["gpus"]} == {"NVIDIA H200"}
    assert {gpu["uuid"] for gpu in inventory["gpus"]} == {None}


def test_gpu_inventory_driver_error(bindir):
    message = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running."
    )
    fake_tool(bindir, "nvidia-smi", f'echo "{message}"; exit 9\n')
    inventory = run_fact(GpuInventory(), [bindir])
    assert inventory["status"] == "error"
    assert inventory["count"] == 0
    assert inventory["error"].startswith("NVIDIA-SMI has failed")


def test_nvswitch_from_pci_class(bindir):
    fake_tool(
        bindir,
        "lspci",
        'printf "%s\\n" "07:00.0 0680: 10de:22a3 (rev a1)" "08:00.0 0680: 10de:22a3 (rev a1)" '
        '"18:00.0 0302: 10de:2335 (rev a1)"\n',
    )
    assert run_fact(NvSwitchPresent(), [bindir]) == {
        "present": True,
        "proc_devices": 0,
        "pci_bridges": 2,
    }


def test_nvswitch_absent_without_lspci(bindir):
    assert run_fact(NvSwitchPresent(), [bindir]) == {
        "present": False,
        "proc_devices": 0,
        "pci_bridges": None,
    }


def test_fabric_manager_state_process():
    fact = FabricManagerState()
    assert fact.requires_command() == "dpkg-query"
    assert fact.process(
        [
            "pkg nvidia-fabricmanager-570 570.158.01-1 hi ",
            "pkg nvidia-fabricmanager-dev-570 570.158.01-1 ii ",
            "pkg nvidia-fabricmanager-550  un ",
            "active active",
            "enabled enabled",
        ]
    ) == {
        "packages": {"nvidia-fabricmanager-570": "570.158.01-1"},
        "version": "570.158.01",
        "binary_version": None,
        "active": "active",
        "enabled": "enabled",
    }


def test_fabric_manager_binary_version_wins():
    # Ubuntu's transitional nvidia-fabricmanager-570 can carry a 580 binary.
    state = FabricManagerState().process(
        [
            "pkg nvidia-fabricmanager-570 570.211.01-0ubuntu1 ii ",
            "binary Fabric Manager version is : 580.173.02 ",
            "active failed",
            "enabled ",
        ]
    )
    assert state["version"] == "580.173.02"
    assert state["active"] == "failed"
    assert state["enabled"] == "not-found"


def test_fabric_manager_command_runs_without_the_service(bindir):
    fake_tool(
        bindir,
        "dpkg-query",
        "printf 'pkg nvidia-fabricmanager-570 570.158.01-1 ii \\n'\n",
    )
    fake_tool(bindir, "systemctl", 'case "$1" in is-active) echo inactive;; esac; exit 3\n')
    state = run_fact(FabricManagerState(), [bindir])
    assert state["version"] == "570.158.01"
    assert state["active"] == "inactive"
    assert state["enabled"] == "not-found"


@pytest.mark.parametrize(
    ("version", "upstream"),
    [
        ("570.158.01-1", "570.158.01"),
        ("570.133.20-0ubuntu1", "570.133.20"),
        ("1:570.86.15-1ubuntu1", "570.86.15"),
        (None, None),
    ],
)
def test_upstream_version(version, upstream):
    assert upstream_version(version) == upstream


def test_kernel_module_reboot_required():
    fact = NvidiaKernelModule()
    assert fact.process(["loaded 550.90.12", "installed 570.158.01"]) == {
        "loaded": "550.90.12",
        "installed": "570.158.01",
        "reboot_required": True,
    }
    assert fact.process(["loaded 570.158.01", "installed 570.158.01"])["reboot_required"] is False
    assert fact.process(["loaded ", "installed 570.158.01"])["reboot_required"] is False


def test_rdma_from_fake_ibv_devinfo(capture, bindir):
    fake_tool(bindir, "ibv_devinfo", capture_printer("h200_ibv_devinfo.txt"))
    rdma = run_fact(RdmaDevices(), [bindir])
    assert rdma["ibv_devinfo"] == "ok"
    assert len(rdma["devices"]) == 11
    assert rdma["devices"]["mlx5_10"]["ports"]["1"] == {
        "state": "PORT_ACTIVE",
        "rate_gbps": None,
        "link_layer": "Ethernet",
    }
    assert rdma["devices"]["mlx5_0"]["fw_ver"] == "28.42.1000"


def test_rdma_sysfs_wins_over_ibv_devinfo():
    fact = RdmaDevices()
    rdma = fact.process(
        [
            "sysfs mlx5_0 1 1: DOWN|40 Gb/sec (4X QDR)|InfiniBand",
            "sysfs mlx5_1 1 4: ACTIVE|400 Gb/sec (4X NDR)|InfiniBand",
            "##ibv_devinfo",
            "hca_id: mlx5_0",
            "        fw_ver:                         28.39.1002",
            "                port:   1",
            "                        state:                  PORT_ACTIVE (4)",
            "##rc 0",
        ]
    )
    assert rdma["devices"]["mlx5_0"]["ports"]["1"]["state"] == "PORT_DOWN"
    assert rdma["devices"]["mlx5_0"]["fw_ver"] == "28.39.1002"
    assert rdma["devices"]["mlx5_1"]["ports"]["1"] == {
        "state": "PORT_ACTIVE",
        "rate_gbps": 400.0,
        "link_layer": "InfiniBand",
    }


def test_rdma_absent(bindir):
    assert run_fact(RdmaDevices(), [bindir]) == {"devices": {}, "ibv_devinfo": "absent"}


def test_peermem():
    assert PeermemLoaded().process(["loaded"]) is True
    assert PeermemLoaded().process(["not-loaded"]) is False


def test_shm_size_of_this_machine(bindir):
    shm = run_fact(ShmSize(), [bindir])
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    stat = os.statvfs("/dev/shm")
    assert shm["size_bytes"] == stat.f_blocks * stat.f_frsize
    assert shm["fstype"] == "tmpfs"


def test_host_resources_of_this_machine(bindir):
    resources = run_fact(HostResources(), [bindir])
    assert resources["cpus"] == len(os.sched_getaffinity(0))  # nproc: the CPUs we may use
    with open("/proc/meminfo") as meminfo:
        total_kib = int(next(ln for ln in meminfo if ln.startswith("MemTotal:")).split()[1])
    assert resources["mem_total_bytes"] == total_kib * 1024


def test_host_resources_without_nproc_or_meminfo():
    fact = HostResources()
    assert fact.process(["nproc ", "MemTotal:     2113047024 kB"]) == {
        "cpus": None,
        "mem_total_bytes": 2113047024 * 1024,
    }
    assert fact.process(["nproc 128"]) == {"cpus": 128, "mem_total_bytes": None}


def test_unit_memlock_prefers_the_unit_probe():
    fact = UnitMemlock()
    assert fact.process(["default 8388608", "unit unlimited"])["infinity"] is True
    assert fact.process(["default infinity", "unit 8192"]) == {
        "default": "infinity",
        "unit": "8192",
        "infinity": False,
    }
    assert fact.process(["default infinity"])["infinity"] is True
    assert fact.process([]) == {"default": None, "unit": None, "infinity": False}


def test_disk_free_walks_up_to_an_existing_parent(tmp_path, bindir):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.safetensors").write_bytes(b"x" * 5000)
    missing = run_fact(DiskFree(), [bindir], path=str(tmp_path / "nope" / "DeepSeek"))
    stat = os.statvfs(tmp_path)
    assert missing["present_bytes"] == 0
    assert missing["size_bytes"] == stat.f_blocks * stat.f_frsize
    present = run_fact(DiskFree(), [bindir], path=str(tmp_path / "models"))
    assert present["present_bytes"] >= 5000
    assert present["mount"] == missing["mount"]


def test_disk_free_quotes_the_path(tmp_path, bindir):
    odd = tmp_path / "a b;touch pwned"
    result = run_fact(DiskFree(), [bindir], path=str(odd))
    assert result["avail_bytes"] > 0
    assert not (Path.cwd() / "pwned").exists()


def test_os_release_and_held_packages():
    assert OsRelease().process(["ID=ubuntu", 'VERSION_ID="24.04"', "VERSION_CODENAME=noble"]) == {
        "ID": "ubuntu",
        "VERSION_ID": "24.04",
        "VERSION_CODENAME": "noble",
    }
    assert HeldPackages().process(["nvidia-fabricmanager-570", ""]) == ["nvidia-fabricmanager-570"]
    assert HeldPackages().requires_command() == "apt-mark"
