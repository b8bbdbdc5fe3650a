"""Labs: the whole set of test hosts (bridge, hosts, state directory, local S3, ports) N times
on one machine, each in its own network namespace.

Lab 0 is the machine's own network namespace: ``python -m testbed up``, the demo and a plain
``pytest`` run use it, as they always did. Lab ``L`` >= 1 is the network namespace
``hgxlab<L>``; a process that enters it (``enter``) sees the same addresses as lab 0 (the bridge
``br-hgx`` at 10.77.0.1, the hosts at 10.77.0.11...), its own loopback (so the demo's S3 on
10.77.0.1:9000 and any port a test opens on 127.0.0.1 clash with no other lab), and everything
it starts (pyinfra, ssh, moto, the hosts' own network namespaces hang off its bridge) stays there.
What is global on the machine gets the lab's index: the hosts' network namespace and cgroup names
(``hgxtb<L>-a``), their nspawn machine names, and the state directory
(``<base>/labs/<L>``, base ``/var/lib/hgxserve-testbed`` or ``$HGXSERVE_TESTBED_DIR``).

Why a network namespace per lab rather than other addresses per lab: every topology, golden
file and test names 10.77.0.x, and the controller's side of a test (pytest, pyinfra, SSH, the
local S3) talks to those addresses. In a namespace of its own a lab keeps them all unchanged.

A lab reaches the package registries as the machine does (the controller builds the hosts'
wheelhouses with pip): an uplink veth (``hgxlab<L>`` on the machine, 10.78.<L>.1/30; ``uplink``
in the lab, 10.78.<L>.2/30) and one masquerade rule for 10.78.0.0/16 in the machine's nftables
table ``hgxserve_labs``. The lab itself forwards nothing, so its test hosts stay offline.

A process holds its lab with an exclusive lock on ``<base>/labs/<L>.lock`` for its lifetime
(``acquire``): two test runs on one machine never share a lab, and a run's labs outlive it only
when ``HGXSERVE_KEEP_TESTBED=1`` (the next run that locks the same index reuses the hosts).

Example::

    from testbed import lab
    index = lab.acquire()           # the first free lab >= 1, locked for this process
    lab.enter(index)                # this thread and everything it starts now live in it
    from testbed import hosts       # hosts.STATE_DIR is the lab's own
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from testbed.util import TestbedError, run, say

DEFAULT_BASE = Path("/var/lib/hgxserve-testbed")
NETNS_PREFIX = "hgxlab"
UPLINK = "uplink"
UPLINK_NET = "10.78.0.0/16"
NAT_TABLE = "hgxserve_labs"
MAX_LABS = 32
# Each test host's systemd, journald, logind and dbus hold inotify instances, all counted for
# root; Debian's default of 128 per user runs out at about 6 labs of 3 hosts.
INOTIFY_INSTANCES = 8192
CLONE_NEWNET = 0x40000000

_held: dict[int, IO[str]] = {}
_root_ns: int | None = None


def current() -> int:
    """The lab this process works in: ``$HGXSERVE_LAB``, else 0 (the machine's own namespace)."""
    value = os.environ.get("HGXSERVE_LAB", "0") or "0"
    if not value.isdigit() or int(value) > MAX_LABS:
        raise TestbedError(f"HGXSERVE_LAB={value!r}: a lab index from 0 to {MAX_LABS}")
    return int(value)


def base_dir() -> Path:
    """The state directory of lab 0, under which every other lab keeps its own:
    ``$HGXSERVE_TESTBED_BASE`` (set by ``enter``), else lab 0's ``$HGXSERVE_TESTBED_DIR``, else
    ``/var/lib/hgxserve-testbed``."""
    base = os.environ.get("HGXSERVE_TESTBED_BASE")
    if not base and current() == 0:
        base = os.environ.get("HGXSERVE_TESTBED_DIR")
    return Path(base or DEFAULT_BASE)


def state_dir(index: int) -> Path:
    """``/var/lib/hgxserve-testbed`` for lab 0, ``.../labs/<L>`` for lab L."""
    return base_dir() if index == 0 else base_dir() / "labs" / str(index)


def netns(index: int) -> str | None:
    """The lab's network namespace; None for lab 0 (the machine's own)."""
    return None if index == 0 else f"{NETNS_PREFIX}{index}"


def host_prefix(index: int) -> str:
    """The prefix of the lab's host netns, cgroup and machine names: ``hgxtb-``, ``hgxtb2-``."""
    return "hgxtb-" if index == 0 else f"hgxtb{index}-"


def _lock_path(index: int) -> Path:
    return base_dir() / "labs" / f"{index}.lock"


def acquire(wanted: int | None = None) -> int:
    """Lock a lab for this process and return its index: ``wanted``, or the first free one.

    The lock is released when the process exits. A wanted lab that another process holds is
    an error naming that lab, never shared.
    """
    (base_dir() / "labs").mkdir(parents=True, exist_ok=True)
    candidates = [wanted] if wanted is not None else list(range(1, MAX_LABS + 1))
    for index in candidates:
        if index in _held:
            return index
        handle = _lock_path(index).open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        _held[index] = handle
        return index
    if wanted is not None:
        raise TestbedError(f"lab {wanted} is in use by another process ({_lock_path(wanted)})")
    raise TestbedError(f"all {MAX_LABS} labs are in use")


def holder(index: int) -> int | None:
    """The PID holding lab ``index``'s lock, or None when it is free."""
    path = _lock_path(index)
    if index in _held:
        return os.getpid()
    if not path.is_file():
        return None
    with path.open("r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = handle.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _libc_setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise TestbedError(f"setns(CLONE_NEWNET) failed: {os.strerror(err)}")


def _sysctl_at_least(name: str, value: int) -> None:
    path = Path("/proc/sys") / name.replace(".", "/")
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text().split()[0]) < value:
            path.write_text(f"{value}\n")


def _machine_side(index: int) -> None:
    """What the machine's own namespace needs for a lab: forwarding and the one NAT rule."""
    if not shutil.which("nft"):
        raise TestbedError("labs need nft on the controller: apt-get install nftables")
    _sysctl_at_least("fs.inotify.max_user_instances", INOTIFY_INSTANCES)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    if run(["nft", "list", "table", "ip", NAT_TABLE], check=False).returncode != 0:
        rules = (
            f"table ip {NAT_TABLE} {{\n"
            "  chain postrouting {\n"
            "    type nat hook postrouting priority srcnat; policy accept;\n"
            f'    ip saddr {UPLINK_NET} oifname != "{NETNS_PREFIX}*" masquerade\n'
            "  }\n"
            "}\n"
        )
        proc = run(["nft", "-f", "-"], input_text=rules, check=False)
        if proc.returncode != 0 and "File exists" not in proc.stderr:
            raise TestbedError(f"cannot add the labs' NAT table: {proc.stderr.strip()}")


def ensure(index: int) -> None:
    """Create lab ``index``'s network namespace with loopback and its uplink (idempotent).

    Runs in the machine's own namespace (before ``enter``); lab 0 needs nothing.
    """
    name = netns(index)
    if name is None:
        return
    if not Path("/run/netns", name).exists():
        run(["ip", "netns", "add", name])
    ns = ["ip", "-n", name]
    run([*ns, "link", "set", "lo", "up"])
    outer = name  # the machine's end of the uplink (at most 15 characters: hgxlab32)
    outer_ip, inner_ip = f"10.78.{index}.1", f"10.78.{index}.2"
    if run([*ns, "link", "show", UPLINK], check=False).returncode != 0:
        # a machine end left from an earlier namespace of this name (the kernel destroys a
        # deleted namespace's veths a little later) is replaced with a whole new pair
        if run(["ip", "link", "show", outer], check=False).returncode == 0:
            run(["ip", "link", "del", outer], check=False)
        run(["ip", "link", "add", outer, "type", "veth", "peer", "name", UPLINK, "netns", name])
        run(["ip", "addr", "add", f"{outer_ip}/30", "dev", outer])
        run([*ns, "addr", "add", f"{inner_ip}/30", "dev", UPLINK])
    run(["ip", "link", "set", outer, "up"])
    run([*ns, "link", "set", UPLINK, "up"])
    if f"default via {outer_ip}" not in run([*ns, "route", "show", "default"]).stdout:
        run([*ns, "route", "replace", "default", "via", outer_ip])
    _machine_side(index)


def enter(index: int) -> None:
    """Move this thread (and every process and thread it starts from now on) into lab
    ``index``, creating the lab when missing; point the harness's state at the lab's directory.

    Call it before ``testbed.hosts`` is imported, from the thread that runs the work: a
    network namespace belongs to a thread, and children inherit their parent thread's.
    """
    global _root_ns
    os.environ["HGXSERVE_TESTBED_BASE"] = str(base_dir())
    os.environ["HGXSERVE_LAB"] = str(index)
    os.environ["HGXSERVE_TESTBED_DIR"] = str(state_dir(index))
    name = netns(index)
    if name is None:
        return
    ensure(index)
    if _root_ns is None:
        _root_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _libc_setns(fd)
    finally:
        os.close(fd)


def leave_and_remove(index: int) -> None:
    """Go back to the machine's namespace and delete lab ``index``'s namespace (its uplink goes
    with it). Only for a lab with no hosts left: their namespaces hang off its bridge."""
    name = netns(index)
    if name is None:
        return
    if _root_ns is not None:
        _libc_setns(_root_ns)
    if Path("/run/netns", name).exists():
        run(["ip", "netns", "del", name], check=False)
    say(f"removed the network namespace {name}")


def in_lab_namespace() -> bool:
    """True when this thread is not in the namespace it started in (it entered a lab)."""
    if _root_ns is None:
        return False
    return os.stat("/proc/thread-self/ns/net").st_ino != os.fstat(_root_ns).st_ino
