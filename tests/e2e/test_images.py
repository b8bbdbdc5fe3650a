"""Hosts on two OS images end to end: hgx-b boots Debian trixie (Python 3.13), hgx-a and hgx-c
bookworm (3.11). From fresh hosts, deploys/site.py builds the agent for each host's own Python
(cp313 on hgx-b, cp311 on the others) and the runtime (the simulated engine's venv), then the
demo P/D topology serves across the two images: prefill on bookworm, decode on trixie, the
release gate passing with the KV pulled over NIXL.

The module boots the mixed hosts in place of the session's and leaves bookworm ones behind.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import site

from testbed import demo
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
IMAGES = ("bookworm", "trixie", "bookworm")
VENV = "/opt/vllm-sim"


@pytest.fixture(scope="module")
def mixed(
    testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[testbed_hosts.Testbed]:
    kinds = [h.gpu for h in testbed.hosts]
    bed = testbed_hosts.up(len(kinds), kinds, list(IMAGES))
    try:
        demo.prepare(bed.names, tmp_path_factory.mktemp("demo"))
        yield bed
    finally:
        demo.stop_s3()
        testbed_hosts.up(len(kinds), kinds)  # the session's hosts: bookworm again


def test_trixie_host_gets_the_agent_for_its_python_and_serves_pd(
    mixed: testbed_hosts.Testbed,
) -> None:
    assert [h.image for h in testbed_hosts.require().hosts] == list(IMAGES)
    python = mixed.ssh("hgx-b", "python3 -c 'import sys; print(sys.version_info[:2])'").stdout
    assert python.strip() == "(3, 13)"
    for name in mixed.names:
        assert mixed.ssh(name, "test -e /opt/hgxserve").returncode != 0  # fresh
    proc = site(mixed, PD)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, text[-4000:]
    # the agent: built for each host's own interpreter and platform
    assert re.search(r"Install the hgxserve agent \w+-cp313-x86_64-glibc2\.\d+ ", text), text
    assert re.search(r"Install the hgxserve agent \w+-cp311-x86_64-glibc2\.36 ", text), text
    agent = mixed.ssh(
        "hgx-b",
        "/opt/hgxserve/bin/python -c 'import sys, hgxserve.cli; print(sys.version_info[:2])'; "
        "/opt/hgxserve/bin/hgxserve --help | head -1",
        check=True,
    ).stdout
    assert agent.startswith("(3, 13)\n"), agent
    assert "-cp313-" in mixed.ssh("hgx-b", "cat /opt/hgxserve/.agent-digest").stdout
    # the runtime on trixie: the simulated engine in a venv of the host's Python 3.13
    runtime = mixed.ssh(
        "hgx-b",
        f"{VENV}/bin/python -c 'import sys, importlib.metadata as m, nixl._api; "
        'print(sys.version_info[:2], m.version("vllm"))\'',
        check=True,
    ).stdout
    assert runtime.strip() == "(3, 13) 0.26.0+sim", runtime
    # served across the images: the gate passed, the decode (trixie) pulled the KV from the
    # prefill (bookworm) over NIXL, and the answer came through P/D
    assert "GATE-OK" in text, text[-4000:]
    assert "decode pulled KV over NIXL" in text, text[-4000:]
    assert "chat probe through P/D answered 'PD_OK'" in text, text[-4000:]
