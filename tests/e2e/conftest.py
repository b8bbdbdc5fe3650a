"""End-to-end fixtures: real systemd-nspawn test hosts for the whole pytest session.

The ``testbed`` fixture brings up 3 hosts (hgx-a/b/c at 10.77.0.11-13; reusing running ones),
yields a ``testbed.hosts.Testbed`` (``names``, ``addresses``, ``ssh(name, cmd)``,
``pyinfra(*args)``) and tears the hosts down at the end of the session unless
``HGXSERVE_KEEP_TESTBED=1`` or another pytest session on this machine still uses them.
``HGXSERVE_TESTBED_GPU`` picks the simulated GPU kind(s) (default ``h200``; e.g. ``h200,h20,h20``).

Example::

    @pytest.mark.e2e
    def test_hostname(testbed):
        assert testbed.ssh("hgx-a", "hostname").stdout.strip() == "hgx-a"
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testbed import hosts  # noqa: E402

TESTBED_HOSTS = 3


def e2e_unavailable() -> str | None:
    """Return why real test hosts cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "e2e tests need root for netns, overlayfs and systemd-nspawn (run as root)"
    if not shutil.which("systemd-nspawn") and not shutil.which("apt-get"):
        return "systemd-nspawn is unavailable (apt-get install systemd-container)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "this kernel has no overlayfs, which the test hosts need"
    if not Path("/proc/self/ns/net").exists():
        return "network namespaces are unavailable"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = e2e_unavailable()
    if reason is None:
        return
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def testbed() -> Iterator[hosts.Testbed]:
    """Three running test hosts for the session; torn down at the end unless kept."""
    reason = e2e_unavailable()
    if reason:
        pytest.skip(reason)
    gpu = os.environ.get("HGXSERVE_TESTBED_GPU", "h200")
    # Several pytest sessions on one machine share the hosts; the last one out tears down.
    hosts.take_lease(os.getpid())
    try:
        bed = hosts.up(TESTBED_HOSTS, gpu)
        yield bed
    finally:
        others = hosts.drop_lease(os.getpid())
        if others:
            print(f"\ntestbed: leaving the test hosts up for pytest PIDs {others}", file=sys.stderr)
        elif os.environ.get("HGXSERVE_KEEP_TESTBED") != "1":
            hosts.down()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's own tokenizer, built locally with the bench venv (no hub download);
    AIPerf counts the bench's prompts with it."""
    dest = tmp_path_factory.mktemp("tokenizer")
    subprocess.run(
        [str(REPO / ".venv-aiperf/bin/python"), str(REPO / "testbed/tiny_llama.py"),
         "--tokenizer-only", str(dest)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return dest
