"""CephFS in place, the default CephFS mode, end to end on the test hosts.

The demo baseline with its model source switched to CephFS (`stage: false`): every host mounts
the model store read-only with the kernel client's `mount -t ceph` (a systemd .mount unit, the
key by secret file pushed from a controller variable), the weights stage verifies the tree in
place with its marker under /var/lib/hgxserve/weights/tiny, and the engine on hgx-a serves from
the mount after its ExecStartPre check-marker read that marker against the pinned digest.

There is no Ceph here: the cluster is SIMULATED (testbed/simceph.py, a controller directory
shared read-only into the hosts; testbed/fakes/mount_ceph.py is the hosts' mount.ceph, which
grants or refuses as the kernel client does and bind-mounts the granted path). The product's
side (unit, options, secret handling, ordering, verification, release) is the real one.

Then the ways it must refuse, each leaving the running release untouched: a pinned digest other
than the tree's, a wrong key (the kernel client's "mount error 13"), a shard changed on the
cluster after it was verified.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_release as release  # the release suite's deploy/result/unit helpers

from testbed import demo, simceph
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
USER = "hgxserve-models"
CEPH_PATH = "/models/tiny"
MOUNT = "/mnt/hgxserve-models"  # the schema's default mount point
UNIT = "mnt-hgxserve\\x2dmodels.mount"
STATE = "/var/lib/hgxserve/weights/tiny"
KEY_VAR = "HGXSERVE_E2E_CEPH_KEY"
SHARD = "model-00001-of-00002.safetensors"
HELPER_LOG = "/var/log/hgxserve-sim/mount.ceph.log"
SOURCE = """\
  source:
    cephfs:
      monitors: [{monitors}]
      path: {path}
      user: {user}
      secret: {{env: {var}}}
"""
CLEANUP = (
    f"systemctl disable --now {shlex.quote(UNIT)} 2>/dev/null; "
    f"rm -f /etc/systemd/system/{shlex.quote(UNIT)} {HELPER_LOG} "
    f"/etc/hgxserve/credentials/cephfs-{USER}.secret; systemctl daemon-reload; "
    f"umount {MOUNT} 2>/dev/null; rmdir {MOUNT} 2>/dev/null; true"
)


@dataclass
class Lab:
    bed: testbed_hosts.Testbed
    topology: Path
    digest: str
    key: str

    def deploy(self, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        """deploys/site.py with `--data` items; the CephX key in the controller's environment."""
        # the CephX key is pushed from the controller's environment: allowed by name
        data = [f"topology={self.topology}", "health_timeout=75", f"allow_env={KEY_VAR}", *args]
        argv = [word for item in data for word in ("--data", item)]
        return self.bed.pyinfra("deploys/site.py", *argv, env={KEY_VAR: key or self.key})


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = tmp_path_factory.mktemp("cephfs")
    model = demo.make_tiny_model(work / "tiny")
    hgx = str(REPO / ".venv/bin/hgxserve")
    subprocess.run([hgx, "weights", "manifest", str(model), "--publish"], check=True)
    digest = json.loads((model / "hgxserve-manifest.json").read_text())["digest"]
    simceph.publish(model, CEPH_PATH)
    key = simceph.add_user(USER, path="/models")
    text = BASELINE.read_text()
    old = text[text.index("  source:\n") : text.index("defaults:")]
    source = SOURCE.format(
        monitors=", ".join(simceph.MONITORS), path=CEPH_PATH, user=USER, var=KEY_VAR
    )
    topology = work / "demo-cephfs.yml"
    text = text.replace(old, source).replace("name: demo-baseline", "name: demo-cephfs")
    topology.write_text(text)
    for name in testbed.names:  # a fresh start: no release, no model store mounted
        testbed.ssh(name, f"{demo.FORGET_RELEASES}; {CLEANUP}", check=True)
    demo.install_credentials(testbed.names)  # the proxy's keys (no S3 in this topology)
    yield Lab(testbed, topology, digest, key)
    for name in testbed.names:
        testbed.ssh(name, f"{demo.FORGET_RELEASES}; {CLEANUP}")
    simceph.remove(CEPH_PATH)
    simceph.remove_user(USER)


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def mount_line(lab: Lab, host: str) -> list[str]:
    """The mount point's /proc/self/mountinfo fields on `host` ([] when not mounted)."""
    out = lab.bed.ssh(host, "cat /proc/self/mountinfo", check=True).stdout
    found = [line.split() for line in out.splitlines() if line.split()[4:5] == [MOUNT]]
    return found[-1] if found else []


def helper_calls(lab: Lab, host: str) -> list[dict]:
    out = lab.bed.ssh(host, f"cat {HELPER_LOG} 2>/dev/null").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def check_marker(lab: Lab, digest: str | None = None) -> subprocess.CompletedProcess[str]:
    """The engine unit's own ExecStartPre check-marker, run by hand on hgx-a (with `digest`
    instead of the unit's pin, if given)."""
    shown = lab.bed.ssh(
        "hgx-a", "systemctl show -p ExecStartPre hgxserve-combined-0.service", check=True
    ).stdout
    argv = next(
        m.group(1) for m in re.finditer(r"argv\[\]=([^;]*);", shown) if "check-marker" in m[1]
    ).strip()
    if digest:
        argv = argv.replace(lab.digest, digest)
    return lab.bed.ssh("hgx-a", argv)


def weights_status(lab: Lab) -> tuple[list[dict], dict]:
    """`hgxserve status --json` of the topology: (its problems, hgx-a's weights part)."""
    proc = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "status", str(lab.topology), "--json",
         "--inventory", "inventory/testhosts.py", "--weights-digest", lab.digest],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.stdout, proc.stderr
    report = json.loads(proc.stdout)
    assert (proc.returncode == 0) == (report["problems"] == []), report["problems"]
    return report["problems"], report["hosts"]["hgx-a"]["snapshot"]["weights"]


def assert_still_serving(lab: Lab, before: dict[str, str]) -> None:
    assert release.units(lab.bed, "hgx-a") == before  # same MainPIDs: nothing restarted
    assert release.complete("10.77.0.11")["choices"][0]["text"]


def test_deploy_serves_from_the_read_only_mount(lab: Lab) -> None:
    started = time.monotonic()
    proc = lab.deploy("stages=runtime,weights,engines", f"weights_digest={lab.digest}")
    print(f"fresh CephFS in-place deploy on 3 hosts: {time.monotonic() - started:.1f} s")
    text = output(proc)
    assert proc.returncode == 0, text[-4000:]
    assert "GATE-OK" in text
    assert release.complete("10.77.0.11")["choices"][0]["text"]
    for host in lab.bed.names:
        fields = mount_line(lab, host)
        assert fields and "ro" in fields[5].split(","), (host, fields)  # per-mount options
        refused = lab.bed.ssh(host, f"touch {MOUNT}/written-by-a-host")
        assert "Read-only file system" in refused.stderr, refused
        marker = lab.bed.ssh(host, f"cat {STATE}/verified", check=True).stdout.strip()
        assert marker == lab.digest
        assert lab.bed.ssh(host, f"test -e {MOUNT}/.hgxserve").returncode == 1
        calls = helper_calls(lab, host)
        assert len(calls) == 1, (host, calls)  # one mount, no remount
        (call,) = calls
        assert call["outcome"] == "mounted read-only", call
        options = call["argv"][call["argv"].index("-o") + 1].split(",")
        assert f"name={USER}" in options and "ro" in options
        assert f"secretfile=/etc/hgxserve/credentials/cephfs-{USER}.secret" in options
        mode = lab.bed.ssh(host, f"stat -c %a /etc/hgxserve/credentials/cephfs-{USER}.secret")
        assert mode.stdout.strip() == "600"
    unit = lab.bed.ssh("hgx-a", "cat /etc/systemd/system/hgxserve-combined-0.service").stdout
    assert (
        f"ExecStartPre=/opt/hgxserve/bin/hgxserve weights check-marker {MOUNT} "
        f"--state-dir {STATE} --digest {lab.digest}\n"
    ) in unit  # the digest given as --data weights_digest= reached the unit
    assert f" serve {MOUNT} " in unit
    for dep in ("After", "Wants"):  # no engine starts before its store is mounted
        assert re.search(rf"^{dep}=.* {re.escape(UNIT)}$", unit, re.M), unit
    assert check_marker(lab).returncode == 0
    # the key: nowhere but the 0600 file (units, mount options, argv, journals, deploy output)
    seen = [text, unit]
    for host in lab.bed.names:
        seen.append(
            lab.bed.ssh(
                host,
                f"cat /etc/systemd/system/{shlex.quote(UNIT)} {HELPER_LOG} /proc/self/mountinfo; "
                "ps -eo args; journalctl --no-pager -o cat",
            ).stdout
        )
    assert all(lab.key not in blob for blob in seen)


def test_second_deploy_changes_nothing_and_remounts_nothing(lab: Lab) -> None:
    before = release.units(lab.bed, "hgx-a")
    mounts = {h: mount_line(lab, h)[0] for h in lab.bed.names}  # mount IDs
    proc = lab.deploy("stages=weights,engines", f"weights_digest={lab.digest}")
    assert proc.returncode == 0, output(proc)[-4000:]
    _, success, error, _ = release.grand_total(proc)
    changed = [
        line
        for line in output(proc).splitlines()
        if re.search(r"\s\d+\s+\d+\s+\S+\s+\S+\s*$", line)
    ]
    assert (success, error) == ("-", "-"), "\n".join(changed)
    assert_still_serving(lab, before)
    for host in lab.bed.names:
        assert mount_line(lab, host)[0] == mounts[host]
        assert len(helper_calls(lab, host)) == 1
    # `hgxserve status` reads the marker where the weights stage wrote it, for the mount
    problems, weights = weights_status(lab)
    assert problems == [], problems
    assert (weights["path"], weights["state_dir"]) == (MOUNT, STATE)
    assert weights["marker"] == lab.digest and weights["intact"], weights


def test_a_pinned_digest_other_than_the_trees_is_refused(lab: Lab) -> None:
    before = release.units(lab.bed, "hgx-a")
    other = "sha256:" + "0" * 64
    proc = lab.deploy("stages=weights", f"weights_digest={other}")
    assert proc.returncode != 0
    assert f"manifest digest is {lab.digest}, but {other} is required" in output(proc)
    for host in lab.bed.names:  # the marker still names the tree's own digest, not the pin
        assert lab.bed.ssh(host, f"cat {STATE}/verified").stdout.strip() == lab.digest
    # and a unit pinned to `other` would not start on this tree
    refused = check_marker(lab, other)
    assert refused.returncode == 1 and other in refused.stdout + refused.stderr, refused
    assert_still_serving(lab, before)


def test_a_wrong_key_is_the_kernel_clients_mount_error(lab: Lab) -> None:
    before = release.units(lab.bed, "hgx-a")
    for host in lab.bed.names:  # as after a reboot: the store is not mounted
        lab.bed.ssh(host, f"systemctl stop {shlex.quote(UNIT)}", check=True)
    wrong = simceph.new_key()
    proc = lab.deploy("stages=weights", key=wrong)
    text = output(proc)
    assert proc.returncode != 0
    assert text.count("mount error 13 = Permission denied") >= len(lab.bed.names), text[-3000:]
    assert wrong not in text
    for host in lab.bed.names:
        assert mount_line(lab, host) == []
    refused = check_marker(lab)  # an engine (re)started now would not start on this tree
    assert refused.returncode == 1, refused
    assert_still_serving(lab, before)


def test_a_shard_changed_on_the_cluster_is_named_and_not_marked(lab: Lab) -> None:
    before = release.units(lab.bed, "hgx-a")
    shard = simceph.fs_path(CEPH_PATH) / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    proc = lab.deploy("stages=weights")  # the right key again: mounts, then verifies
    text = output(proc)
    assert proc.returncode != 0
    assert f"{SHARD}: sha256" in text, text[-3000:]
    for host in lab.bed.names:
        assert mount_line(lab, host), host
        assert lab.bed.ssh(host, f"test -e {STATE}/verified").returncode == 1, host
    assert check_marker(lab).returncode == 1
    problems, weights = weights_status(lab)
    assert not weights["marker"], weights  # status says so too
    assert any(p["host"] == "hgx-a" and p["part"] == "weights" for p in problems), problems
    assert_still_serving(lab, before)
