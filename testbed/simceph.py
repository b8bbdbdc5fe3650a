"""A simulated CephFS cluster for the test hosts (there is no Ceph here).

The "cluster" is a directory on the controller (``hosts.SIM_CEPH_DIR``), shared read-only into
every test host at boot; the simulated ``mount.ceph`` on the hosts (testbed/fakes/mount_ceph.py)
grants or refuses a kernel-client mount against it and bind-mounts the granted path read-only.
It stands in for the monitors (their addresses), CephX (one key per user, checked by its
sha256; the key itself never enters the share) and MDS path caps; what it cannot show is said in
docs/weights.md ("CephFS").

Layout of the share::

    cluster.json                  {"fsid": ..., "monitors": ["10.77.0.1:6789"]}
    auth/client.<user>.json       {"key_sha256": ..., "path": "/models", "access": "r"}
    fs/<path>/...                 the file system's tree

Example::

    from testbed import simceph
    key = simceph.add_user("hgxserve-models", path="/models")
    simceph.publish(Path("/tmp/tiny"), "/models/tiny")
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

from testbed import hosts
from testbed.util import TestbedError

FSID = "6f1c2b7e-5a1d-4c3e-9b8a-00000000c3f5"
# the controller's bridge address: a test host reaches it, and nothing listens on 6789 (the
# simulated client never connects; it checks the address against the cluster's list)
MONITORS = [f"{hosts.BRIDGE_ADDRESS}:6789"]


def root() -> Path:
    """The cluster's directory on the controller (created with its layout when missing)."""
    base = hosts.SIM_CEPH_DIR
    for sub in ("auth", "fs"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    config = base / "cluster.json"
    wanted = json.dumps({"fsid": FSID, "monitors": MONITORS}, indent=2) + "\n"
    if not config.is_file() or config.read_text() != wanted:
        config.write_text(wanted)
    return base


def new_key() -> str:
    """A key in CephX's format: base64 of (type 1, created sec/nsec, length 16, 16 bytes)."""
    now = time.time()
    secret = os.urandom(16)
    blob = struct.pack("<HIIH", 1, int(now), int(now % 1 * 1e9), len(secret)) + secret
    return base64.b64encode(blob).decode()


def add_user(name: str, *, path: str = "/", access: str = "r") -> str:
    """Create (or re-key) `client.<name>` with caps on `path`; return its new key."""
    if not name or "/" in name or name.startswith("."):
        raise TestbedError(f"bad simulated CephX user name {name!r}")
    if access not in ("r", "rw"):
        raise TestbedError(f"access must be r or rw, not {access!r}")
    key = new_key()
    digest = hashlib.sha256(key.encode()).hexdigest()
    record = {"key_sha256": digest, "path": path, "access": access}
    (root() / "auth" / f"client.{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return key


def remove_user(name: str) -> None:
    (root() / "auth" / f"client.{name}.json").unlink(missing_ok=True)


def fs_path(path: str) -> Path:
    """The controller directory behind CephFS path `path` (e.g. "/models/tiny")."""
    parts = Path(path).parts
    if not path.startswith("/") or ".." in parts:
        raise TestbedError(f"bad CephFS path {path!r}")
    return root() / "fs" / path.strip("/")


def publish(tree: Path, path: str) -> Path:
    """Put a copy of `tree` at CephFS path `path` (replacing what was there); return it."""
    dest = fs_path(path)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(tree, dest)
    return dest


def remove(path: str) -> None:
    """Remove CephFS path `path` from the simulated cluster."""
    shutil.rmtree(fs_path(path), ignore_errors=True)
