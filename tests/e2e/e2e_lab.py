"""What the e2e modules share about a lab: a fresh demo lab for a module, a release deploy with
the test bounds, pyinfra's output and results, the hosts' units and release links.

Example::

    @pytest.fixture(scope="module")
    def lab(testbed, tmp_path_factory):
        with demo_lab(testbed, tmp_path_factory.mktemp("demo"), runtime=PD) as bed:
            yield bed
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed import demo
from testbed import hosts as testbed_hosts

# 75 s caps each engine's start wait (the topologies' start_timeout_s is 30 min; a simulated
# engine starts in seconds); 120 s is the dead-man timer of a switch. Both are `--data` keys a
# user sets the same way, not product defaults lowered for tests.
HEALTH_TIMEOUT_S = 75
CONFIRM_WITHIN_S = 120


def opt_in(variable: str, setup: str) -> pytest.MarkDecorator:
    """Skip unless `variable` is 1: a suite that needs what scripts/`setup` installs first."""
    return pytest.mark.skipif(
        os.environ.get(variable) != "1", reason=f"opt-in: set {variable}=1 (after scripts/{setup})"
    )


def api_request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    """A JSON POST of `body` to `url` (the demo's proxy), with the demo topology's API key."""
    return urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {demo.DEMO_API_KEY}",
        },
    )


@contextlib.contextmanager
def demo_lab(
    testbed: testbed_hosts.Testbed,
    work: Path,
    *,
    runtime: Path | None = None,
    forget: str = "",
    after: str = "",
) -> Iterator[testbed_hosts.Testbed]:
    """Hosts that never ran an hgxserve release (and ran `forget` too), the demo's S3 with the
    tiny model (testbed/demo.py), and `runtime`'s engine installed when given; afterwards the
    S3 stops and the hosts hold no release again (and ran `after`), as other modules expect."""
    extra = f"; {forget}" if forget else ""
    for name in testbed.names:
        testbed.ssh(name, demo.FORGET_RELEASES + extra, check=True, timeout=120)
    demo.prepare(testbed.names, work)
    if runtime is not None:
        proc = testbed.pyinfra("deploys/runtime.py", "--data", f"topology={runtime}")
        assert proc.returncode == 0, output(proc)[-3000:]
    yield testbed
    demo.stop_s3()
    tail = f"; {after}" if after else ""
    for name in testbed.names:
        testbed.ssh(name, demo.FORGET_RELEASES + tail, timeout=120)


def deploy(
    lab: testbed_hosts.Testbed,
    script: str,
    *data: str,
    health_timeout: int = HEALTH_TIMEOUT_S,
    confirm_within: int = CONFIRM_WITHIN_S,
) -> subprocess.CompletedProcess[str]:
    """The real pyinfra CLI running `script` with `--data` items and the test bounds."""
    args = [script]
    for item in (*data, f"health_timeout={health_timeout}", f"confirm_within={confirm_within}"):
        args += ["--data", item]
    return lab.pyinfra(*args)


def site(
    lab: testbed_hosts.Testbed, topology: Path, stages: str = "runtime,weights,engines"
) -> subprocess.CompletedProcess[str]:
    """deploys/site.py of `topology`'s `stages`, with the test bounds."""
    return deploy(lab, "deploys/site.py", f"topology={topology}", f"stages={stages}")


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def grand_total(proc: subprocess.CompletedProcess[str]) -> tuple[str, str, str, str]:
    """(operations, success, error, no change) from pyinfra's results table."""
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(proc))
    assert match, output(proc)[-3000:]
    return match.groups()  # type: ignore[return-value]


def units(lab: testbed_hosts.Testbed, host: str) -> dict[str, str]:
    """Active hgxserve engine/proxy units -> MainPID."""
    out = lab.ssh(
        host,
        "for u in $(systemctl list-units 'hgxserve-*' --state=active --no-legend --plain "
        "| awk '{print $1}' | grep -v reconcile); do "
        'echo "$u $(systemctl show -p MainPID --value $u)"; done',
    ).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def links(lab: testbed_hosts.Testbed, host: str) -> dict:
    """The host's release store: current, previous, baseline, pending."""
    proc = lab.ssh(host, "/opt/hgxserve/bin/hgxserve release status", check=True)
    return json.loads(proc.stdout)
