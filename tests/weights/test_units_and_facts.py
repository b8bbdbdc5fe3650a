"""The CephFS mount unit (systemd-analyze verify) and the ModelManifestState fact parser."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from hgxserve.parsers.probes import parse_manifest_state
from hgxserve.weights.cephfs import mount_unit, unit_name
from hgxserve.weights.options import SyncArgs, sync_command


def test_unit_name_matches_systemd_escape() -> None:
    assert unit_name("/mnt/hgxserve-models") == "mnt-hgxserve\\x2dmodels.mount"
    assert unit_name("/srv/models/ds.v4") == "srv-models-ds.v4.mount"


def test_mount_unit_is_read_only_and_holds_no_key(tmp_path: Path) -> None:
    text = mount_unit(
        ["10.0.0.1:6789"], "/models/x", "models-ro", "/etc/ceph/k.secret", "/mnt/hgxserve-models"
    )
    options = next(line for line in text.splitlines() if line.startswith("Options="))
    assert options.split("=", 1)[1].split(",")[:3] == [
        "name=models-ro",
        "secretfile=/etc/ceph/k.secret",
        "ro",
    ]
    assert "Type=ceph" in text and "What=10.0.0.1:6789:/models/x" in text
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    unit = tmp_path / unit_name("/mnt/hgxserve-models")
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    problems = [
        line
        for line in proc.stderr.splitlines()
        if unit.name in line or "Unknown" in line or "Invalid" in line
    ]
    assert problems == []


def test_fact_parser_treats_garbage_as_unverified() -> None:
    assert parse_manifest_state(["##marker", "##state", "{not json", "##check", "absent"]) == {
        "marker": None,
        "source": None,
        "manifest_digest": None,
        "files": 0,
        "check": "absent",
    }
    state = '{"source": "s3://b/m/", "manifest_digest": "sha256:ab", "files": {"a": {}}}'
    assert parse_manifest_state(["##marker", "sha256:ab", "##state", state, "##check", "ok"]) == {
        "marker": "sha256:ab",
        "source": "s3://b/m/",
        "manifest_digest": "sha256:ab",
        "files": 1,
        "check": "ok",
    }


def test_sync_command_never_carries_secrets() -> None:
    command = sync_command(SyncArgs("s3://b/m/", "/models/m", env_file="/etc/hgxserve/s3.env"))
    assert "--env-file /etc/hgxserve/s3.env" in command
    assert "SECRET" not in command.upper().replace("--ENV-FILE", "")


def test_the_mount_unit_file_is_compared_without_its_escaped_name(tmp_path: Path) -> None:
    """A unit named `mnt-hgxserve\\x2dmodels.mount`: pyinfra's hash fact cannot read GNU
    sha1sum's line for it (a leading backslash, an escaped name), so files.put would upload it
    on every run; FileDigest hashes stdin and reads it back."""
    from pyinfra.facts.files import Sha1File

    from hgxserve.facts.files import FileDigest

    path = tmp_path / unit_name("/mnt/hgxserve-models")
    path.write_text("[Mount]\n")
    path.chmod(0o644)
    sha1 = subprocess.run(["sha1sum", str(path)], capture_output=True, text=True, check=True)
    fact = Sha1File()
    fact.command(str(path))
    assert fact.process(sha1.stdout.splitlines()) is None  # what files.put would see
    ours = FileDigest()
    out = subprocess.run(
        ["sh", "-c", ours.command(str(path))], capture_output=True, text=True, check=True
    )
    digest = hashlib.sha256(b"[Mount]\n").hexdigest()
    assert ours.process(out.stdout.splitlines()) == ("644", digest)
    gone = subprocess.run(
        ["sh", "-c", ours.command(str(tmp_path / "none"))], capture_output=True, text=True
    )
    assert ours.process(gone.stdout.splitlines()) is None
