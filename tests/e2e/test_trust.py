"""The weights' trust root and the secrets a deploy pushes, end to end: the real pyinfra CLI
against the test hosts, the demo model in the real local S3, its digest pinned by the inventory
(inventory/testhosts.py names the pins file testbed/demo.py writes when it publishes the model).

- trust_remote_code with no pin for the model: refused before anything runs on a host;
- the inventory's pin is what the hosts verify: a wrong pin fails the weights stage, the right
  one passes and is the marker the engine units check;
- `{env: VAR}` for a VAR the inventory does not allow, or holding a short API key: refused
  before anything is pushed; an API key file readable by others on a host: refused.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from testbed import demo
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
AGENT = "/opt/hgxserve/bin/hgxserve"
KEY_VAR = "HGXSERVE_E2E_PROXY_KEY"
PUSHED_KEY = "/etc/hgxserve/credentials/api-key"  # where the release role writes an env key


@dataclass
class Lab:
    bed: testbed_hosts.Testbed
    work: Path
    digest: str  # the published manifest's, pinned by the inventory

    def topology(self, name: str, *replacements: tuple[str, str]) -> Path:
        text = BASELINE.read_text().replace("name: demo-baseline", f"name: {name}")
        for old, new in replacements:
            assert old in text, old
            text = text.replace(old, new)
        path = self.work / f"{name}.yml"
        path.write_text(text)
        return path

    def deploy(
        self, script: str, topology: Path, *data: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        args = [script, "--data", f"topology={topology}", "--data", "health_timeout=75"]
        for item in data:
            args += ["--data", item]
        return self.bed.pyinfra(*args, env=env)


REMOTE_CODE = (
    ("    max_num_seqs: 8\n", "    max_num_seqs: 8\n    trust_remote_code: true\n"),
    ("  path: /models/tiny\n", "  path: /models/tiny\n  digest_from: inventory\n"),
)


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = tmp_path_factory.mktemp("trust")
    for name in testbed.names:  # no release, no synced model: what a refusal must leave alone
        testbed.ssh(name, f"{demo.FORGET_RELEASES}; rm -rf /models/tiny", check=True)
    demo.prepare(testbed.names, work)
    pins = YAML(typ="safe").load(demo.PINS.read_text())
    yield Lab(testbed, work, pins["s3://models/tiny"])
    for name in testbed.names:
        testbed.ssh(name, f"{demo.FORGET_RELEASES}; chmod 600 /etc/credstore/*")


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def test_unpinned_remote_code_is_refused_before_anything_runs(lab: Lab) -> None:
    topology = lab.topology("demo-remote-code", *REMOTE_CODE)
    other = lab.work / "other-pins.yml"  # the inventory's pins, without this model
    other.write_text(f"some-other-model: {lab.digest}\n")
    proc = lab.deploy("deploys/weights.py", topology, f"model_pins={other}")
    text = output(proc)
    assert proc.returncode != 0, text[-3000:]
    assert (
        "$.defaults.args.trust_remote_code: trust_remote_code runs Python from the model tree, "
        "and model tiny is not pinned"
    ) in text
    assert "'s3://models/tiny: sha256:...'" in text  # how to pin it
    for name in lab.bed.names:  # nothing ran: no agent call, no model tree
        assert lab.bed.ssh(name, "test -e /models/tiny").returncode == 1
    plan = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "plan", str(topology), "--inventory",
         "inventory/testhosts.py"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr  # the inventory's own pins file pins it
    assert f"weights trust root: pins file {demo.PINS} ({lab.digest})" in plan.stdout


def test_the_inventory_pin_is_what_the_hosts_verify(lab: Lab) -> None:
    topology = lab.topology("demo-remote-code", *REMOTE_CODE)
    wrong = lab.work / "wrong-pins.yml"
    zeros = f"sha256:{'0' * 64}"
    wrong.write_text(f"tiny: {zeros}\n")
    proc = lab.deploy("deploys/weights.py", topology, f"model_pins={wrong}")
    text = output(proc)
    assert proc.returncode != 0, text[-3000:]
    assert zeros in text  # the sync was held to the pin
    # what an engine unit pinned so runs before it starts: no tree verified for that pin
    refused = lab.bed.ssh("hgx-a", f"{AGENT} weights check-marker /models/tiny --digest {zeros}")
    assert refused.returncode != 0, refused.stdout
    marker = f"{AGENT} weights check-marker /models/tiny --digest {lab.digest}"
    proc = lab.deploy("deploys/weights.py", topology)  # the inventory's pins file
    text = output(proc)
    assert proc.returncode == 0, text[-3000:]
    for name in lab.bed.names:
        assert lab.bed.ssh(name, marker).returncode == 0, name
    again = lab.deploy("deploys/weights.py", topology)  # idempotent: nothing to change
    assert again.returncode == 0, output(again)[-3000:]
    totals = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)", output(again))
    assert totals and totals.groups()[1:] == ("-", "-"), output(again)[-3000:]


def test_env_secrets_need_the_inventory_allowance_and_a_full_key(lab: Lab) -> None:
    topology = lab.topology(
        "demo-env-key",
        ("api_key: {credential: hgxserve-api-key}", f"api_key: {{env: {KEY_VAR}}}"),
    )
    key = "k" * 8 + "0123456789abcdef0123456789abcdef"
    proc = lab.deploy("deploys/engines.py", topology, env={KEY_VAR: key})
    text = output(proc)
    assert proc.returncode != 0, text[-3000:]
    assert (
        f"$.proxy.auth.api_key: {{env: {KEY_VAR}}} would push the controller's environment "
        f"variable {KEY_VAR} to the hosts, and the inventory does not allow it"
    ) in text
    assert f"allow_env: [{KEY_VAR}]" in text
    short = "short-proxy-key"
    proc = lab.deploy("deploys/engines.py", topology, f"allow_env={KEY_VAR}", env={KEY_VAR: short})
    text = output(proc)
    assert proc.returncode != 0, text[-3000:]
    assert f"environment variable {KEY_VAR}: 15 characters, shorter than the 32 required" in text
    assert short not in text
    for name in lab.bed.names:  # refused before anything was pushed
        assert lab.bed.ssh(name, f"test -e {PUSHED_KEY}").returncode == 1, name


def test_an_api_key_file_others_can_read_is_refused(lab: Lab) -> None:
    lab.bed.ssh("hgx-a", "chmod 644 /etc/credstore/hgxserve-api-key", check=True)
    try:
        proc = lab.deploy("deploys/engines.py", BASELINE)
    finally:
        lab.bed.ssh("hgx-a", "chmod 600 /etc/credstore/hgxserve-api-key", check=True)
    text = output(proc)
    assert proc.returncode != 0, text[-3000:]
    assert (
        "hgx-a: $.proxy.auth.api_key: API key file /etc/credstore/hgxserve-api-key: mode 0644 "
        "lets group or others at it (chmod 600)"
    ) in text
    assert demo.DEMO_API_KEY not in text
