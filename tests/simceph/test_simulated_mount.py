"""The SIMULATED CephFS of the test hosts (testbed/simceph.py, testbed/fakes/mount_ceph.py):
the fake mount.ceph grants and refuses as the kernel client does, against a cluster made by
simceph. The bind mount itself is only recorded here (it needs a host's mount namespace; the
e2e test tests/e2e/test_cephfs.py mounts for real)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from testbed import hosts, simceph  # noqa: E402

MON = simceph.MONITORS[0]


def load_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sim_mount_ceph", REPO / "testbed/fakes/mount_ceph.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(hosts, "SIM_CEPH_DIR", tmp_path / "cluster")
    helper = load_helper()
    monkeypatch.setattr(helper, "CLUSTER", tmp_path / "cluster")  # the host sees it here
    monkeypatch.setattr(helper, "LOG", tmp_path / "mount.ceph.log")
    binds: list[list[str]] = []

    def bind(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        binds.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(helper.subprocess, "run", bind)
    tree = tmp_path / "tiny"
    tree.mkdir()
    (tree / "config.json").write_text("{}")
    simceph.publish(tree, "/models/tiny")
    (tmp_path / "other").mkdir()
    simceph.publish(tmp_path / "other", "/private/x")
    key = simceph.add_user("models-ro", path="/models")
    secret = tmp_path / "models-ro.secret"
    secret.write_text(key + "\n")
    secret.chmod(0o600)
    helper.binds = binds
    helper.key, helper.secret, helper.tmp = key, secret, tmp_path
    return helper


def mount(helper: Any, device: str, options: str) -> int:
    return int(helper.main([device, "/mnt/m", "-n", "-o", options]))


def test_a_granted_mount_binds_the_path_read_only_and_logs_no_key(cluster: Any) -> None:
    options = f"name=models-ro,secretfile={cluster.secret},ro,noatime,_netdev"
    assert mount(cluster, f"{MON},10.77.0.9:6789:/models/tiny", options) == 0
    source = str(cluster.tmp / "cluster/fs/models/tiny")
    assert cluster.binds == [["mount", "--bind", "-o", "ro", source, "/mnt/m"]]
    (entry,) = [json.loads(line) for line in cluster.LOG.read_text().splitlines()]
    assert entry["outcome"] == "mounted read-only"
    assert cluster.key not in cluster.LOG.read_text()


def test_a_secret_given_inline_is_masked_in_the_log(cluster: Any) -> None:
    assert mount(cluster, f"{MON}:/models/tiny", f"name=models-ro,secret={cluster.key}") == 0
    assert cluster.binds[0][:3] == ["mount", "--bind", str(cluster.tmp / "cluster/fs/models/tiny")]
    assert cluster.key not in cluster.LOG.read_text()
    assert "secret=<hidden>" in cluster.LOG.read_text()


@pytest.mark.parametrize(
    ("device", "options", "status", "message"),
    [
        (f"{MON}:/models/tiny", "name=models-ro,secretfile=KEY,ro", 32, None),  # wrong key
        (f"{MON}:/models/tiny", "name=nobody,secretfile=SECRET,ro", 32, "13"),
        (f"{MON}:/models/tiny", "secretfile=SECRET,ro", 32, "13"),  # client.guest
        (f"{MON}:/private/x", "name=models-ro,secretfile=SECRET,ro", 32, "13"),  # outside caps
        (f"{MON}:/models/none", "name=models-ro,secretfile=SECRET,ro", 32, "2"),
        ("10.77.0.9:6789:/models/tiny", "name=models-ro,secretfile=SECRET", 32, "110"),
        (f"{MON}:/models/tiny", "name=models-ro,secretfile=SECRET,bogus", 32, "22"),
        (f"{MON}:/models/tiny", "name=models-ro,secretfile=/nonexistent,ro", 1, "secretfile"),
        (f"{MON}/models/tiny", "name=models-ro,secretfile=SECRET", 1, "path"),
    ],
)
def test_refused_as_the_kernel_client_refuses(
    cluster: Any,
    capsys: pytest.CaptureFixture[str],
    device: str,
    options: str,
    status: int,
    message: str | None,
) -> None:
    wrong = cluster.tmp / "wrong.secret"
    wrong.write_text(simceph.new_key())
    options = options.replace("SECRET", str(cluster.secret)).replace("KEY", str(wrong))
    assert mount(cluster, device, options) == status
    err = capsys.readouterr().err
    expected = {
        None: "mount error 13 = Permission denied",
        "13": "mount error 13 = Permission denied",
        "2": "mount error 2 = No such file or directory",
        "110": "mount error 110 = Connection timed out",
        "22": "mount error 22 = Invalid argument",
        "secretfile": "unable to read secretfile: No such file or directory",
        "path": "source mount path was not specified",
    }[message]
    assert expected in err
    assert cluster.binds == []
    assert cluster.key not in err + cluster.LOG.read_text()


def test_a_new_key_has_cephx_format_and_rekeying_revokes_the_old_one(cluster: Any) -> None:
    key = simceph.new_key()
    assert len(key) == 40 and key.startswith("AQ")
    old = cluster.secret.read_text()
    simceph.add_user("models-ro", path="/models")
    assert mount(cluster, f"{MON}:/models/tiny", f"name=models-ro,secret={old.strip()}") == 32


def test_the_hosts_get_the_helper_where_mount_looks_and_the_share_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (REPO / "testbed/hosts.py").read_text()
    assert '"usr/sbin/mount.ceph"' in text
    assert str(load_helper().CLUSTER) == hosts.SIM_CEPH_MOUNT
    monkeypatch.setattr(hosts, "SIM_CEPH_DIR", tmp_path / "cluster")
    assert f"--bind-ro={tmp_path / 'cluster'}:{hosts.SIM_CEPH_MOUNT}" in hosts._binds()
