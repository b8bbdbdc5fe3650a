"""Build, cache and unpack the Debian root filesystems the test hosts boot, one per image.

An image is a Debian suite (``bookworm``: Python 3.11, ``trixie``: Python 3.13). Each tree is
built once with debootstrap, packed as a zstd tarball under ``/var/cache/hgxserve-testbed/``
(named by suite and recipe) and unpacked into lab 0's state directory as the read-only lower
layer of the overlayfs of every host of that image, in every lab (testbed/lab.py).

Example::

    lower = ensure_rootfs(Path("/var/lib/hgxserve-testbed"), "trixie")
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from testbed.util import TestbedError, say

SUITE = "bookworm"  # the default image
# The images a test host can boot, with the Python each one ships (docs/provision.md's table).
SUITES = {"bookworm": "3.11", "trixie": "3.13"}
VARIANT = "minbase"
# What a test host needs: systemd as PID 1, sshd, a Python for pyinfra facts and the simulated
# engine, venv/pip for roles that build runtime venvs, the basic tools facts run, Debian's
# UCX library (libucp), which the runtime preflight looks for beside NIXL on P/D hosts; podman,
# which the container runtime role loads engine images into (with netavark: podman's
# container-network-stack, a virtual package debootstrap does not resolve by itself); Debian's
# Prometheus and node exporter, which the monitoring stage installs from the hosts' mirror (the
# test hosts have none: here they are preinstalled, their units left disabled until the stage
# enables them); nftables, the host firewall the release stage loads (real hosts install it from
# their mirror like the other provision packages); Debian's pyzmq and msgpack, which the simulated
# engine imports only when --kv-events-config asks it to publish KV events (as the real engines
# do over ZMQ with msgpack payloads).
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-pip",
    "iproute2",
    "procps",
    "kmod",
    "util-linux",
    "ca-certificates",
    "curl",
    "libucx0",
    "podman",
    "netavark",
    "prometheus",
    "prometheus-node-exporter",
    "nftables",
    "python3-zmq",
    # what python3-zmq needs through the virtual python3-cffi-backend-api-*, which debootstrap
    # does not resolve by itself (as with podman's netavark)
    "python3-cffi-backend",
    "python3-msgpack",
)
# Units of preinstalled packages that only a deploy stage may enable and start.
DISABLED_UNITS = ("prometheus.service", "prometheus-node-exporter.service")
# Bump when the post-install recipe below changes, so caches built by an older recipe are rebuilt.
RECIPE_VERSION = 2
CACHE_DIR = Path(os.environ.get("HGXSERVE_TESTBED_CACHE", "/var/cache/hgxserve-testbed"))

SSHD_DROPIN = """\
# hgxserve test host: key-only root login for the harness and pyinfra
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""
JOURNALD_DROPIN = """\
# hgxserve test host: keep the journal in memory and small
[Journal]
Storage=volatile
RuntimeMaxUse=16M
"""
SIM_TMPFILES = """\
# hgxserve test host: simulated engines report GPU memory use here (read by the fake nvidia-smi);
# sticky and world-writable, as engines run as an unprivileged user (a real driver's memory use
# is the kernel's, not a file)
d /run/hgxserve-sim 0755 root root -
d /run/hgxserve-sim/gpus 1777 root root -
"""


def check_suite(suite: str) -> str:
    """Return ``suite`` when the testbed builds that image, else fail naming the ones it does."""
    if suite not in SUITES:
        known = ", ".join(SUITES)
        raise TestbedError(f"unknown test-host image {suite!r}: the testbed builds {known}")
    return suite


def stamp(suite: str = SUITE) -> str:
    """Return the version stamp of a suite's rootfs recipe (changes with the package list).

    Example: ``stamp("bookworm")`` -> ``"3f9c0a1b2d4e"``
    """
    recipe = {
        "suite": suite,
        "variant": VARIANT,
        "packages": sorted(PACKAGES),
        "recipe": RECIPE_VERSION,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def cache_path(suite: str = SUITE) -> Path:
    """Return the path of the cached tarball for a suite's current recipe.

    Example: ``/var/cache/hgxserve-testbed/rootfs-bookworm-3f9c0a1b2d4e.tar.zst``
    """
    return CACHE_DIR / f"rootfs-{suite}-{stamp(suite)}.tar.zst"


def _deb822_mirrors(text: str) -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = ""
        for line in stanza.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0] in " \t" and key:
                fields[key] += " " + line.strip()
                continue
            if ":" in line:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        found.extend((uri, suites) for uri in fields.get("uris", "").split())
    return found


def _one_line_mirrors(text: str) -> list[tuple[str, list[str]]]:
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        words = re.sub(r"\[[^]]*\]", " ", line).split()
        if len(words) >= 3 and words[0] == "deb":
            found.append((words[1], [words[2]]))
    return found


def apt_mirror(apt_dir: Path = Path("/etc/apt"), suite: str = SUITE) -> str:
    """Return the Debian mirror this machine's apt uses for the main archive.

    ``HGXSERVE_TESTBED_MIRROR`` overrides it. Example: ``apt_mirror()`` -> ``"http://deb.debian.org/debian"``
    """
    override = os.environ.get("HGXSERVE_TESTBED_MIRROR")
    if override:
        return override
    sources: list[tuple[str, list[str]]] = []
    for path in sorted(apt_dir.glob("sources.list.d/*.sources")):
        sources += _deb822_mirrors(path.read_text(errors="replace"))
    for path in [apt_dir / "sources.list", *sorted(apt_dir.glob("sources.list.d/*.list"))]:
        if path.is_file():
            sources += _one_line_mirrors(path.read_text(errors="replace"))
    release = ""
    os_release = Path("/etc/os-release")
    if os_release.is_file():
        match = re.search(r"^VERSION_CODENAME=(\S+)", os_release.read_text(), re.M)
        release = match.group(1).strip('"') if match else ""
    # The main archive carries the bare suite name; -security and -updates archives do not.
    for wanted in (suite, release):
        for uri, suites in sources:
            if wanted and wanted in suites:
                return uri.rstrip("/")
    raise TestbedError(
        "no Debian mirror found in /etc/apt sources (looked for a 'deb' entry with suite "
        f"'{suite}'); set HGXSERVE_TESTBED_MIRROR=http://<mirror>/debian"
    )


def _post_install(root: Path, suite: str) -> None:
    """Make the debootstrapped tree a template: no identity, no apt cache, sshd and journald set."""
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.is_symlink() or dbus_id.exists():
        dbus_id.unlink()
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    lists = root / "var/lib/apt/lists"
    for entry in lists.iterdir() if lists.is_dir() else []:
        if entry.is_file():
            entry.unlink()
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/hgxserve-testbed.conf").write_text(SSHD_DROPIN)
    (root / "etc/systemd/journald.conf.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/systemd/journald.conf.d/hgxserve-testbed.conf").write_text(JOURNALD_DROPIN)
    (root / "etc/tmpfiles.d/hgxserve-sim.conf").write_text(SIM_TMPFILES)
    for unit in DISABLED_UNITS:
        for link in (root / "etc/systemd/system").glob(f"*.wants/{unit}"):
            link.unlink()
    (root / "etc/hgxserve-testbed").mkdir(exist_ok=True)
    (root / "etc/hgxserve-testbed/rootfs-stamp").write_text(stamp(suite) + "\n")


def build(work_dir: Path, suite: str = SUITE) -> Path:
    """Run debootstrap into ``work_dir/build-<stamp>`` and pack it into the cache; return the tree.

    Example: ``build(Path("/var/lib/hgxserve-testbed"), "trixie")``
    """
    mirror = apt_mirror(suite=suite)
    tree = work_dir / f"build-{stamp(suite)}"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    say(f"building the {suite} rootfs with debootstrap from {mirror} (about 2 minutes, once)")
    started = time.monotonic()
    cmd = [
        "debootstrap",
        f"--variant={VARIANT}",
        "--include=" + ",".join(PACKAGES),
        suite,
        str(tree),
        mirror,
    ]
    log = work_dir / f"debootstrap-{suite}.log"
    with log.open("wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        lines = "\n  ".join(tail)
        raise TestbedError(f"debootstrap failed (log: {log}):\n  {lines}")
    _post_install(tree, suite)
    say(f"debootstrap done in {time.monotonic() - started:.0f} s; packing the cache")
    pack(tree, cache_path(suite))
    return tree


def pack(tree: Path, target: Path) -> None:
    """Pack ``tree`` into the zstd tarball ``target`` (written atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    started = time.monotonic()
    tar = subprocess.Popen(
        [
            "tar",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "-C",
            str(tree),
            "-cf",
            "-",
            ".",
        ],
        stdout=subprocess.PIPE,
    )
    zstd = subprocess.run(
        ["zstd", "-q", "-10", "-T0", "-f", "-o", str(partial)], stdin=tar.stdout, check=False
    )
    assert tar.stdout is not None
    tar.stdout.close()
    if tar.wait() != 0 or zstd.returncode != 0:
        partial.unlink(missing_ok=True)
        raise TestbedError(f"packing the rootfs into {target} failed")
    partial.rename(target)
    size = target.stat().st_size / 2**20
    say(f"cached {target} ({size:.0f} MiB) in {time.monotonic() - started:.0f} s")


def unpack(tarball: Path, target: Path) -> None:
    """Unpack a cached rootfs tarball into ``target`` (replaced atomically)."""
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    started = time.monotonic()
    zstd = subprocess.Popen(["zstd", "-q", "-dc", str(tarball)], stdout=subprocess.PIPE)
    tar = subprocess.run(
        [
            "tar",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "-C",
            str(partial),
            "-xf",
            "-",
        ],
        stdin=zstd.stdout,
        check=False,
    )
    assert zstd.stdout is not None
    zstd.stdout.close()
    if zstd.wait() != 0 or tar.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise TestbedError(f"unpacking {tarball} failed; delete it to rebuild")
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    say(f"unpacked {tarball.name} in {time.monotonic() - started:.1f} s")


def ensure_rootfs(work_dir: Path, suite: str = SUITE) -> Path:
    """Return the unpacked lower tree for a suite's recipe, building or unpacking as needed.

    Example: ``ensure_rootfs(Path("/var/lib/hgxserve-testbed"))`` -> ``.../rootfs/3f9c0a1b2d4e``
    """
    check_suite(suite)
    lower = work_dir / "rootfs" / stamp(suite)
    marker = lower / "etc/hgxserve-testbed/rootfs-stamp"
    if marker.is_file() and marker.read_text().strip() == stamp(suite):
        return lower
    lower.parent.mkdir(parents=True, exist_ok=True)
    # Several labs (testbed/lab.py) share the trees and the cache: one builds or unpacks while
    # the others wait, then find it done.
    with (lower.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == stamp(suite):
            return lower
        return _ensure_rootfs_locked(work_dir, suite, lower)


def _ensure_rootfs_locked(work_dir: Path, suite: str, lower: Path) -> Path:
    # Older recipes' trees are never the lower layer of a running host (down removes hosts
    # first), so they can go; the current tree of every image stays.
    current = {stamp(name) for name in SUITES}
    for old in lower.parent.iterdir():
        if old.name not in current and not old.name.endswith(".partial") and old.name[0] != ".":
            say(f"removing rootfs of an older recipe: {old}")
            shutil.rmtree(old, ignore_errors=True)
    tarball = cache_path(suite)
    if tarball.is_file():
        unpack(tarball, lower)
        return lower
    tree = build(work_dir, suite)
    if lower.exists():
        shutil.rmtree(lower)
    tree.rename(lower)
    return lower


def ensure_cached() -> None:
    """Fail early with a clear message when the cache directory cannot be written."""
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TestbedError(f"cannot create the rootfs cache {CACHE_DIR}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    """``python3 -m testbed.rootfs [SUITE...]``: build (or unpack) the test hosts' trees ahead
    of ``up``, with the standard library only, so scripts/demo.sh runs it beside the venvs'
    installs."""
    from testbed import lab

    suites = argv if argv is not None else sys.argv[1:]
    try:
        ensure_cached()
        for suite in suites or [SUITE]:
            ensure_rootfs(lab.base_dir(), suite)
    except TestbedError as exc:
        print(f"testbed: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
