"""Provisioning on real test hosts: host tuning, packages from a local apt repo, preflight.

The packages are dummy .deb files built here with dpkg-deb under the real names the roles
install on Debian 12 (driver, persistence daemon, Fabric Manager, RDMA/UCX); the daemons'
units run `sleep`. Everything runs on one host (hgx-c) through the real pyinfra CLI.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

HOST = "hgx-c"
REPO_DIR = "/srv/hgx-e2e-repo"
DRIVER = "570.158.01"
SHM = "3Gi"
SHM_BYTES = 3 * 1024**3
SHADOWED = "/usr/local/sbin/nvidia-smi /usr/local/sbin/lspci /usr/local/sbin/nv-fabricmanager"
DAEMON_UNITS = {
    "nvidia-persistenced": "nvidia-persistenced.service",
    f"nvidia-fabricmanager-{DRIVER.split('.')[0]}": "nvidia-fabricmanager.service",
}
PACKAGES = {
    "nvidia-driver-cuda": f"{DRIVER}-1",
    "nvidia-kernel-open-dkms": f"{DRIVER}-1",
    "nvidia-persistenced": f"{DRIVER}-1",
    "nvidia-fabricmanager-570": f"{DRIVER}-1",
    "rdma-core": "99.0-1",
    "ibverbs-utils": "99.0-1",
    "infiniband-diags": "99.0-1",
    "perftest": "99.0-1",
    "libucx0": "99.0-1",
    "ucx-utils": "99.0-1",
}
TOPOLOGY = """\
name: provision-e2e
description: Provisioning test on the local test hosts
baseline: false
hosts:
  hgx-a: {{address: 10.77.0.11, gpu: H200, gpus: 8}}
  hgx-b: {{address: 10.77.0.12, gpu: H200, gpus: 8}}
  hgx-c: {{address: 10.77.0.13, gpu: {gpu}, gpus: 8, rdma: [mlx5_0, mlx5_1], shm: {shm}}}
model:
  name: tiny
  served_name: tiny
  path: /models/provision-e2e
  size: 1Mi
  source: {{local: {{path: /models/provision-e2e}}}}
defaults:
  engine: vllm
  version: 0.26.0
  runtime: {{venv: /opt/vllm-sim}}
engines:
  combined-0:
    role: combined
    place: {{hgx-c: [0, 1, 2, 3, 4, 5, 6, 7]}}
    tp: 8
    port: 8100
proxy:
  host: hgx-c
  listen: 0.0.0.0:8000
  combined: [combined-0]
"""


def build_repo(root: Path) -> Path:
    """Dummy .debs (daemons get a unit that sleeps) and a flat repo index."""
    repo = root / "repo"
    repo.mkdir()
    for name, version in PACKAGES.items():
        tree = root / "build" / name
        (tree / "DEBIAN").mkdir(parents=True)
        (tree / "DEBIAN" / "control").write_text(
            f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
            "Maintainer: hgxserve tests <tests@hgxserve.invalid>\n"
            f"Description: hgxserve test stand-in for {name}\n"
        )
        unit = DAEMON_UNITS.get(name)
        if unit:
            (tree / "lib/systemd/system").mkdir(parents=True)
            (tree / "lib/systemd/system" / unit).write_text(
                f"[Unit]\nDescription=test stand-in for {name}\n\n"
                "[Service]\nExecStart=/bin/sleep infinity\n\n"
                "[Install]\nWantedBy=multi-user.target\n"
            )
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-b", str(tree), str(repo / f"{name}.deb")],
            check=True,
            capture_output=True,
        )
    index = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (repo / "Packages").write_text(index)
    return repo


def changes(result: subprocess.CompletedProcess[str]) -> int:
    """Operations that changed something: the Success column of pyinfra's `Grand total` row."""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    total = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    assert total, text[-3000:]
    success = total.group(2)
    return 0 if success == "-" else int(success)


CLEAN = (
    "apt-mark unhold " + " ".join(PACKAGES) + " >/dev/null 2>&1; "
    "systemctl disable --now nvidia-fabricmanager nvidia-persistenced >/dev/null 2>&1; "
    "DEBIAN_FRONTEND=noninteractive dpkg --purge " + " ".join(PACKAGES) + " >/dev/null 2>&1; "
    "rm -f /etc/apt/sources.list.d/hgxserve-nvidia.list /etc/apt/preferences.d/hgxserve-nvidia "
    "/etc/systemd/system.conf.d/hgxserve-memlock.conf "
    "/etc/security/limits.d/90-hgxserve-memlock.conf "
    "/etc/sysctl.d/90-hgxserve.conf /etc/tmpfiles.d/hgxserve-shm.conf "
    "/etc/modules-load.d/nvidia-peermem.conf /usr/local/sbin/nvidia-smi /usr/local/sbin/lspci "
    "/usr/local/sbin/nv-fabricmanager; "
    "sed -i '\\|[[:space:]]/dev/shm[[:space:]]|d' /etc/fstab; systemctl daemon-reexec; true"
)


@pytest.fixture(scope="module")
def bed(testbed, tmp_path_factory):
    if not shutil.which("dpkg-deb") or not shutil.which("dpkg-scanpackages"):
        pytest.skip("dpkg-deb/dpkg-scanpackages missing (apt-get install dpkg-dev)")
    work = tmp_path_factory.mktemp("provision")
    repo = build_repo(work)
    target = testbed.host(HOST).merged / REPO_DIR.lstrip("/")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(repo, target)
    # The test hosts have no internet: keep apt from waiting on the Debian mirror.
    testbed.ssh(
        HOST,
        CLEAN + "; [ -f /etc/apt/sources.list ] && "
        "mv /etc/apt/sources.list /etc/apt/sources.list.hgx-e2e; true",
    )
    topo = work / "topology.yml"
    topo.write_text(TOPOLOGY.format(gpu="H200", shm=SHM))
    # the engine the topology runs, so preflight's runtime checks find it
    runtime = testbed.pyinfra("deploys/runtime.py", "--limit", HOST, "--data", f"topology={topo}")
    assert runtime.returncode == 0, (runtime.stdout + runtime.stderr)[-3000:]
    yield testbed, topo, work
    testbed.ssh(
        HOST,
        CLEAN + f"; rm -rf {REPO_DIR}; "
        "mv /etc/apt/sources.list.hgx-e2e /etc/apt/sources.list 2>/dev/null; true",
    )


def memlock_ceiling_kib(bed_tuple) -> str:
    """The hard memlock limit of the host's PID 1: no unit can get more.

    On bare metal it is `unlimited`; a test host inherits the controller's hard limit (8 MiB
    here) and systemd in the container cannot raise it, so units get at most that.
    """
    hard = ssh(bed_tuple, "awk '/Max locked memory/ {print $5}' /proc/1/limits")
    return "unlimited" if hard == "unlimited" else str(int(hard) // 1024)


def provision(bed_tuple, *extra: str) -> subprocess.CompletedProcess[str]:
    testbed, topo, _ = bed_tuple
    return testbed.pyinfra(
        "deploys/provision.py",
        "--limit",
        HOST,
        "--data",
        f"topology={topo}",
        "--data",
        f"apt_source=deb [trusted=yes] file:{REPO_DIR} ./",
        "--data",
        "fabric_manager=always",
        # /proc/sys is read-only and there is no NVIDIA kernel module in a test host.
        "--data",
        "load_now=false",
        *extra,
    )


def ssh(bed_tuple, command: str) -> str:
    result = bed_tuple[0].ssh(HOST, command)
    return result.stdout.strip()


def test_provision_converges_then_changes_nothing(bed):
    started = time.monotonic()
    first = provision(bed)
    first_s = time.monotonic() - started
    first_changes = changes(first)
    started = time.monotonic()
    second = provision(bed)
    second_s = time.monotonic() - started
    second_changes = changes(second)
    print(f"\nprovision on {HOST}: first run {first_changes} changes in {first_s:.1f}s, "
          f"second run {second_changes} changes in {second_s:.1f}s")  # fmt: skip
    assert first_changes >= 8
    assert second_changes == 0, second.stdout[-6000:]
    assert "apt-get update" not in second.stdout


def test_packages_installed_at_driver_version_and_held(bed):
    versions = ssh(bed, "dpkg-query -W -f='${Package} ${Version}\\n' " + " ".join(PACKAGES))
    assert sorted(versions.splitlines()) == sorted(f"{p} {v}" for p, v in PACKAGES.items())
    held = ssh(bed, "apt-mark showhold").split()
    assert {"nvidia-driver-cuda", "nvidia-fabricmanager-570", "nvidia-persistenced"} <= set(held)
    for unit in DAEMON_UNITS.values():
        assert ssh(bed, f"systemctl is-active {unit}; systemctl is-enabled {unit}").split() == [
            "active",
            "enabled",
        ]


def test_unit_started_afterwards_gets_memlock_infinity(bed):
    assert ssh(bed, "systemctl show --property=DefaultLimitMEMLOCK --value") == "infinity"
    out = ssh(
        bed,
        "systemd-run --quiet --unit=hgx-e2e-memlock --collect --property=Type=exec "
        "/bin/sleep 30 && systemctl show -p LimitMEMLOCK hgx-e2e-memlock; "
        "systemctl stop hgx-e2e-memlock",
    )
    assert out == "LimitMEMLOCK=infinity"
    # What the unit really gets: unlimited on bare metal, the container's ceiling here.
    effective = ssh(bed, "systemd-run --quiet --wait --pipe --collect sh -c 'ulimit -l'")
    assert effective == memlock_ceiling_kib(bed)


def test_shm_sized_live_and_in_fstab(bed):
    assert ssh(bed, "df -B1 --output=size /dev/shm | tail -n 1") == str(SHM_BYTES)
    assert (
        ssh(bed, "grep -c '^tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=3g 0 0$' /etc/fstab") == "1"
    )


def test_boot_files_present(bed):
    assert "vm.max_map_count = 1048576" in ssh(bed, "cat /etc/sysctl.d/90-hgxserve.conf")
    assert ssh(bed, "grep -v '^#' /etc/modules-load.d/nvidia-peermem.conf") == "nvidia-peermem"
    tmpfiles = ssh(bed, "grep '^r ' /etc/tmpfiles.d/hgxserve-shm.conf").splitlines()
    assert "r /dev/shm/nccl-*" in tmpfiles and "r /dev/shm/psm_*" in tmpfiles
    # The rule really removes leaked segments and leaves other files alone.
    out = ssh(
        bed,
        "touch /dev/shm/nccl-e2eleak /dev/shm/keep-e2e; "
        "systemd-tmpfiles --remove /etc/tmpfiles.d/hgxserve-shm.conf; "
        "ls /dev/shm/nccl-e2eleak /dev/shm/keep-e2e 2>/dev/null; rm -f /dev/shm/keep-e2e",
    )
    assert out == "/dev/shm/keep-e2e"


def memlock_problems(bed) -> list[str]:
    """The memlock problem preflight must report when the test host caps memlock (see above)."""
    ceiling = memlock_ceiling_kib(bed)
    if ceiling == "unlimited":
        return []
    return [
        f"hgx-c: memlock: expected infinity for systemd units, found "
        f"DefaultLimitMEMLOCK=infinity, unit ulimit -l={ceiling}"
    ]


def preflight_output(result: subprocess.CompletedProcess[str]) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)


def test_preflight_on_matching_host(bed):
    testbed, topo, _ = bed
    result = testbed.pyinfra("deploys/preflight.py", "--limit", HOST, "--data", f"topology={topo}")
    expected = memlock_problems(bed)
    if not expected:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return
    # The unit probe sees the container's memlock ceiling and says so; nothing else differs.
    output = preflight_output(result)
    assert result.returncode != 0
    assert "preflight failed on hgx-c (1 problem):\n  " + expected[0] in output


def test_preflight_fails_on_seven_gpus_and_fm_mismatch(bed):
    testbed, topo, _ = bed
    # Shadow the simulated tools for this host only: the real capture minus its last GPU,
    # NVSwitches on PCI, and a Fabric Manager binary of another driver version.
    ssh(
        bed,
        "mkdir -p /usr/local/sbin && cat > /usr/local/sbin/nvidia-smi <<'EOF'\n"
        "#!/bin/sh\n"
        'case "$1" in --query-gpu=*) /usr/local/bin/nvidia-smi "$@" | head -n 7;; '
        '*) exec /usr/local/bin/nvidia-smi "$@";; esac\n'
        "EOF\n"
        "printf '#!/bin/sh\\necho \"07:00.0 0680: 10de:22a3 (rev a1)\"\\n' "
        "> /usr/local/sbin/lspci; "
        "printf '#!/bin/sh\\necho \"Fabric Manager version is : 570.133.20\"\\n' "
        "> /usr/local/sbin/nv-fabricmanager; "
        f"chmod 755 {SHADOWED}",
    )
    try:
        result = testbed.pyinfra(
            "deploys/preflight.py", "--limit", HOST, "--data", f"topology={topo}"
        )
    finally:
        ssh(
            bed,
            f"rm -f {SHADOWED}",
        )
    output = preflight_output(result)
    problems = [
        "hgx-c: gpu.count: expected 8, found 7",
        "hgx-c: fabric_manager.version: expected 570.158.01 (the driver's; NVSwitch present), "
        "found 570.133.20",
        *memlock_problems(bed),
    ]
    assert result.returncode != 0
    assert (
        f"preflight failed on hgx-c ({len(problems)} problems):\n  " + "\n  ".join(problems)
        in output
    )
    assert "Traceback" not in output


def test_provision_refuses_wrong_gpu_kind_before_changing_anything(bed):
    testbed, _, work = bed
    topo = work / "wrong-kind.yml"
    topo.write_text(TOPOLOGY.format(gpu="H20", shm="4Gi"))
    before = ssh(bed, "md5sum /etc/fstab")
    result = testbed.pyinfra(
        "deploys/provision.py", "--limit", HOST, "--data", f"topology={topo}",
        "--data", f"apt_source=deb [trusted=yes] file:{REPO_DIR} ./", "--data", "load_now=false",
    )  # fmt: skip
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    assert result.returncode != 0
    assert (
        "hgx-c: gpu.name: expected H20 on every GPU, found NVIDIA H200 on GPU 0,1,2,3,4,5,6,7"
        in output
    )
    assert ssh(bed, "md5sum /etc/fstab") == before
