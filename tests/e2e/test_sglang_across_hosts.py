"""SGLang P/D with the proxy beside the prefill and the decode on another host, on the test
hosts: the prefill must bind an address the decode reaches, because SGLang (and the simulated
engine, testbed/simengine.py) binds its disaggregation bootstrap server to --host. With the
old loopback default the decode on hgx-b dialled 10.77.0.11:8998 and found nothing there.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import demo_lab, site

from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SGLANG_PD = REPO / "topologies/demo/demo-sglang-pd.yml"
LONG_PROMPT = " ".join(f"the release gate checks word {i}." for i in range(20))  # ~155 tokens


@pytest.fixture(scope="module")
def beside(
    testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[testbed_hosts.Testbed, Path]]:
    """demo-sglang-pd with its proxy moved from hgx-c to hgx-a, the prefill's host."""
    work = tmp_path_factory.mktemp("sglang-beside")
    text = SGLANG_PD.read_text()
    for old, new in (
        ("  host: hgx-c\n", "  host: hgx-a\n"),
        ("name: demo-sglang-pd\n", "name: sglang-pd-beside\n"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    topology = work / "sglang-pd-beside.yml"
    topology.write_text(text)
    with demo_lab(testbed, work) as bed:
        yield bed, topology


def _complete(address: str, prompt: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    req = urllib.request.Request(
        f"http://{address}:8000/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_decode_on_another_host_reaches_the_bootstrap_of_a_prefill_beside_the_proxy(
    beside: tuple[testbed_hosts.Testbed, Path],
) -> None:
    lab, topology = beside
    # a fresh start: the (simulated) SGLang runtime, the weights from the local S3, the release
    proc: subprocess.CompletedProcess = site(lab, topology)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "SGLang prefill served" in text and "0 failed transfers" in text
    unit = lab.ssh("hgx-a", "systemctl cat hgxserve-prefill-0.service", check=True).stdout
    assert "--host 0.0.0.0 --port 30000" in unit
    config = lab.ssh("hgx-a", "cat /etc/hgxserve/proxy.json", check=True).stdout
    prefill = json.loads(config)["pd_groups"][0]["prefill"][0]
    assert prefill["bootstrap_host"] == "10.77.0.11" and prefill["bootstrap_port"] == 8998
    answer = _complete("10.77.0.11", LONG_PROMPT + " Only answer: SGL_OK")
    assert answer["choices"][0]["text"] == "SGL_OK"
