#!/usr/bin/python3
"""Simulated ``mount.ceph`` for hgxserve test hosts: the CephFS kernel client's mount, refused
and granted as a real cluster would, served from the simulated cluster (testbed/simceph.py).

Installed as /usr/sbin/mount.ceph, where mount(8) looks for the helper of `-t ceph`; systemd's
`Type=ceph` mount units run `mount -t ceph WHAT WHERE -o OPTIONS`, which calls::

    mount.ceph MON1:PORT[,MON2:PORT...]:/PATH WHERE [-sfnv] [-N NS] -o name=USER,secretfile=F,ro,...

The simulated cluster is a directory the controller shares read-only into every host at
``CLUSTER`` (``cluster.json``: fsid and monitor addresses; ``auth/client.USER.json``: the sha256
of the user's key and its caps, never the key; ``fs/``: the file system's tree). Checked in the
kernel client's order, with its errors (mount.ceph prints ``mount error N = strerror`` and
exits 32; its own option and secret-file errors exit 1):

- an option the kernel client does not know: error 22;
- no named monitor belongs to the cluster: error 110 (the kernel waits ``mount_timeout``, 60 s,
  for a monitor that never answers; here at once);
- no ``name=``/unknown user/no or wrong key: error 13 (an unreadable ``secretfile`` fails before,
  in mount.ceph itself: "unable to read secretfile: ...");
- the path is outside the user's caps: error 13; the path does not exist: error 2.

Granted, the path is bind-mounted at WHERE, read-only when ``ro`` is asked (always read-only
underneath: the share is). Every call is logged to ``LOG`` (argv with any ``secret=`` value
masked, the outcome), so tests can read what the product asked for.

Example::

    mount.ceph 10.77.0.1:6789:/models/tiny /mnt/m -o name=models-ro,secretfile=/etc/ceph/k,ro
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

CLUSTER = Path("/var/lib/hgxserve-sim/ceph")
LOG = Path("/var/log/hgxserve-sim/mount.ceph.log")
EX_USAGE, EX_FAIL = 1, 32
# options the kernel client takes without a value, and those mount.ceph consumes itself
FLAGS = {
    "ro", "rw", "noatime", "nodiratime", "relatime", "strictatime", "nosuid", "suid", "nodev",
    "dev", "noexec", "exec", "sync", "_netdev", "noauto", "nofail", "dirstat", "nodirstat",
    "rbytes", "norbytes", "nocrc", "noasyncreaddir", "noquotadf",
}  # fmt: skip
VALUED = {
    "name", "secret", "secretfile", "fs", "mds_namespace", "mon_addr", "ms_mode", "rsize",
    "wsize", "rasize", "mount_timeout", "caps_max", "readdir_max_entries", "fsid", "conf",
}  # fmt: skip


class Refused(Exception):
    """What the real client prints and its exit status."""

    def __init__(self, message: str, status: int = EX_FAIL) -> None:
        super().__init__(message)
        self.status = status


def kernel_error(errno_: int) -> Refused:
    return Refused(f"mount error {errno_} = {os.strerror(errno_)}")


def parse_argv(argv: list[str]) -> tuple[str, str, str]:
    """(device, mount point, options) from mount(8)'s helper call."""
    if len(argv) < 2:
        raise Refused("usage: mount.ceph [src] [mount-point] [-n] [-v] [-o ceph-options]", EX_USAGE)
    device, where, rest = argv[0], argv[1], argv[2:]
    options = ""
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg in ("-o", "-N", "-t"):
            if i + 1 >= len(rest):
                raise Refused(f"Option {arg} requires an argument.", EX_USAGE)
            if arg == "-o":
                options = ",".join(o for o in (options, rest[i + 1]) if o)
            i += 2
            continue
        if arg not in ("-s", "-f", "-n", "-v"):
            raise Refused(f"Can't understand option: '{arg}'", EX_USAGE)
        i += 1
    return device, where, options


def parse_device(device: str) -> tuple[list[str], str]:
    """`mon1:port,mon2:port:/path` -> (monitors, /path)."""
    at = device.find(":/")
    if at < 0:
        raise Refused("source mount path was not specified", EX_USAGE)
    if at == 0:
        raise Refused("server address expected", EX_USAGE)
    monitors, path = device[:at].split(","), device[at + 1 :]
    for mon in monitors:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+(:[0-9]+)?", mon):
            raise Refused(f"failed to resolve source (monitor {mon!r})", EX_USAGE)
    return [m if ":" in m else f"{m}:6789" for m in monitors], path


def parse_options(options: str) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if eq and not value:
            raise Refused(f"mount option {key} requires a value.", EX_USAGE)
        if (key not in VALUED) if eq else (key not in FLAGS):
            raise kernel_error(22)  # the kernel refuses an option it does not know
        parsed[key] = value if eq else ""
    return parsed


def read_secret(options: dict[str, str]) -> str | None:
    if "secretfile" in options:
        try:
            return Path(options["secretfile"]).read_text().strip()
        except OSError as exc:
            raise Refused(
                f"unable to read secretfile: {exc.strerror}\n"
                f"error reading secret file: -{exc.errno}\nfailed to parse ceph_options",
                EX_USAGE,
            ) from None
    return options.get("secret")


def within(path: str, prefix: str) -> bool:
    path, prefix = path.rstrip("/") or "/", prefix.rstrip("/") or "/"
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def authorize(monitors: list[str], path: str, options: dict[str, str]) -> Path:
    """The directory to mount, or Refused as the kernel client would refuse."""
    try:
        cluster = json.loads((CLUSTER / "cluster.json").read_text())
    except (OSError, ValueError):
        raise kernel_error(110) from None  # no cluster behind any monitor: a timeout
    if not set(monitors) & set(cluster.get("monitors", [])):
        raise kernel_error(110)
    secret = read_secret(options)
    user = options.get("name", "guest")
    try:
        record = json.loads((CLUSTER / "auth" / f"client.{user}.json").read_text())
    except (OSError, ValueError):
        raise kernel_error(13) from None
    if not secret or hashlib.sha256(secret.encode()).hexdigest() != record.get("key_sha256"):
        raise kernel_error(13)
    if not within(path, record.get("path", "/")):
        raise kernel_error(13)
    tree = CLUSTER / "fs" / path.strip("/")
    if ".." in Path(path).parts or not tree.is_dir():
        raise kernel_error(2)
    return tree


def log(argv: list[str], outcome: str) -> None:
    shown = [re.sub(r"(^|,)secret=[^,]*", r"\1secret=<hidden>", a) for a in argv]
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with LOG.open("a") as fh:
        fh.write(json.dumps({"time": time.time(), "argv": shown, "outcome": outcome}) + "\n")


def main(argv: list[str]) -> int:
    try:
        device, where, raw = parse_argv(argv)
        monitors, path = parse_device(device)
        options = parse_options(raw)
        tree = authorize(monitors, path, options)
        read_only = "ro" in options and "rw" not in options
        bind = ["mount", "--bind", *(["-o", "ro"] if read_only else []), str(tree), where]
        done = subprocess.run(bind, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise Refused(f"mount error: {done.stderr.strip()}")
    except Refused as exc:
        log(argv, str(exc))
        print(exc, file=sys.stderr)
        return exc.status
    log(argv, "mounted read-only" if read_only else "mounted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
