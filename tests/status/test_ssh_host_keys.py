"""Trusting a host key on first use (`accept-new`, the default) is said, with the key's
fingerprint as `ssh-keygen -lf` prints it, and the key is remembered."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import paramiko
import pytest

from hgxserve.remote import ssh


class _Client:
    def __init__(self, known: str | None) -> None:
        self.keys = paramiko.HostKeys()
        self._hgxserve_known_hosts = known

    def get_host_keys(self) -> Any:
        return self.keys


def test_a_new_host_key_is_said_and_remembered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = paramiko.RSAKey.generate(1024)
    known = tmp_path / "known_hosts"
    ssh._AcceptNew().missing_host_key(_Client(str(known)), "10.77.0.11", key)
    said = capsys.readouterr().err
    assert "ssh: 10.77.0.11: new host key ssh-rsa SHA256:" in said
    assert f"added to {known}" in said
    assert known.read_text() == f"10.77.0.11 ssh-rsa {key.get_base64()}\n"
    if shutil.which("ssh-keygen"):
        pub = tmp_path / "k.pub"
        pub.write_text(f"ssh-rsa {key.get_base64()}\n")
        listed = subprocess.run(
            ["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True
        ).stdout.split()[1]
        assert f" {listed} " in said


def test_a_key_not_remembered_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    key = paramiko.RSAKey.generate(1024)
    ssh._AcceptNew().missing_host_key(_Client(None), "hgx-b", key)
    assert "not remembered" in capsys.readouterr().err
