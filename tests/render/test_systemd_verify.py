"""Every rendered unit passes `systemd-analyze verify` with empty stderr.

The units are installed into a scratch root with the distribution's own units and a fake
executable at every path the units run (ExecStart*, ExecStop*), so verify checks our files
offline (TESTHOSTS.md: unknown keys and bad values only warn, hence the empty-stderr check).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, TEST_TOPOLOGIES

from hgxserve.render import render_topology
from hgxserve.topology import load_topology

ANALYZE = shutil.which("systemd-analyze")
SYSTEM_UNITS = next(
    (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None
)
TOPOLOGIES = sorted((ROOT / "topologies").glob("**/*.yml")) + sorted(TEST_TOPOLOGIES.glob("*.yml"))
EXEC = re.compile(r"^Exec(?:Start|StartPre|Reload|Stop|StopPost)=[-@:+!]*(/\S+)", re.M)

pytestmark = pytest.mark.skipif(
    ANALYZE is None or SYSTEM_UNITS is None,
    reason="systemd-analyze is not installed (apt-get install systemd)",
)


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_units_verify_clean(path: Path, tmp_path: Path):
    assert ANALYZE is not None and SYSTEM_UNITS is not None
    for host, rendered in render_topology(load_topology(path)).items():
        root = tmp_path / host
        shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
        unit_dir = root / "etc/systemd/system"
        unit_dir.mkdir(parents=True)
        for unit in rendered.units:
            (unit_dir / unit.name).write_text(unit.content)
            for program in EXEC.findall(unit.content):
                fake = root / program.lstrip("/")
                fake.parent.mkdir(parents=True, exist_ok=True)
                fake.write_text("#!/bin/sh\nexit 0\n")
                fake.chmod(0o755)
        for unit in rendered.units:
            done = subprocess.run(
                [ANALYZE, "verify", f"--root={root}", unit.name],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, (unit.name, done.stdout, done.stderr)
            assert done.stderr == "", (unit.name, done.stderr)


def test_verify_catches_a_bad_value(tmp_path: Path):
    """The check above can fail: a wrong Restart= value shows up on stderr."""
    assert ANALYZE is not None and SYSTEM_UNITS is not None
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin/true").write_text("#!/bin/sh\n")
    (root / "bin/true").chmod(0o755)
    (root / "etc/systemd/system/x.service").write_text(
        "[Service]\nExecStart=/bin/true\nRestart=sometimes\n"
    )
    done = subprocess.run(
        [ANALYZE, "verify", f"--root={root}", "x.service"], capture_output=True, text=True
    )
    assert "restart specifier" in done.stderr
