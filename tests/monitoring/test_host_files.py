"""What the monitoring stage writes on each host: which host gets what, the DCGM exporter unit
(package and container forms) passing `systemd-analyze verify`, pinned versions, ARGS files."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hgxserve.monitoring.host_files import (
    DCGM_PACKAGES,
    DCGM_UNIT,
    dcgm_exporter_unit,
    host_monitoring,
    node_exporter_args,
    prometheus_args,
)
from hgxserve.topology import load_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MONITORED = str(HERE / "demo-pd-monitored.yml")
ANALYZE = shutil.which("systemd-analyze")
SYSTEM_UNITS = next(
    (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None
)
EXEC = re.compile(r"^Exec(?:Start|StartPre|Stop|StopPost)=[-@:+!]*(/\S+)", re.M)
IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter@sha256:" + "0" * 64


def test_each_host_gets_its_part() -> None:
    topo = load_topology(MONITORED)
    a, c = host_monitoring(topo, "hgx-a"), host_monitoring(topo, "hgx-c")
    assert a is not None and c is not None
    assert a.node_exporter_args == (
        'ARGS="--web.listen-address=:9100 --collector.systemd '
        '--collector.systemd.unit-include=hgxserve-.+[.]service"\n'
    )
    assert a.dcgm_packages == DCGM_PACKAGES
    assert a.prometheus_files == {} and a.prometheus_args is None
    assert c.prometheus_args == (
        'ARGS="--web.listen-address=:9090 --storage.tsdb.retention.time=1d"\n'
    )
    assert sorted(c.prometheus_files) == [
        "/etc/prometheus/hgxserve/file_sd/demo-pd-dcgm.json",
        "/etc/prometheus/hgxserve/file_sd/demo-pd-engine.json",
        "/etc/prometheus/hgxserve/file_sd/demo-pd-node.json",
        "/etc/prometheus/hgxserve/file_sd/demo-pd-proxy.json",
        "/etc/prometheus/hgxserve/rules/demo-pd.rules.yml",
        "/etc/prometheus/hgxserve/scrape-configs.yml",
        "/etc/prometheus/prometheus.yml",
    ]
    # a topology without monitoring: the stage does nothing; a host off the topology neither
    plain = load_topology(str(REPO / "topologies/demo/demo-pd.yml"))
    assert host_monitoring(plain, "hgx-a") is None
    assert host_monitoring(topo, "hgx-z") is None


def test_dcgm_versions_are_pinned_pairs() -> None:
    assert dict(DCGM_PACKAGES) == {
        "datacenter-gpu-manager-4-core": "4.6.0",
        "datacenter-gpu-manager-exporter": "4.8.3",
    }


def test_args_files() -> None:
    topo = load_topology(MONITORED)
    assert node_exporter_args(9101).startswith('ARGS="--web.listen-address=:9101 ')
    assert topo.monitoring is not None
    assert "--storage.tsdb.retention.time=1d" in prometheus_args(topo.monitoring)


@pytest.mark.skipif(ANALYZE is None or SYSTEM_UNITS is None, reason="systemd-analyze missing")
@pytest.mark.parametrize("source", ["package", "container"])
def test_dcgm_unit_verifies_clean(tmp_path: Path, source: str) -> None:
    assert ANALYZE is not None and SYSTEM_UNITS is not None
    topo = load_topology(MONITORED)
    assert topo.monitoring is not None
    mon = dataclasses.replace(topo.monitoring, dcgm_source=source, dcgm_image=IMAGE)
    unit = dcgm_exporter_unit(topo, mon)
    assert (unit.vendor_unit is not None) == (source == "package")
    text = unit.text
    if source == "container":
        assert "--pull=never" in text and IMAGE in text
    else:
        assert (
            "ExecStart=/usr/bin/dcgm-exporter -f /etc/hgxserve/monitoring/dcgm-counters.csv" in text
        )
    for line in ("NoNewPrivileges=yes", "ProtectHome=yes", "PrivateTmp=yes"):
        assert line in text
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system" / DCGM_UNIT).write_text(text)
    for program in EXEC.findall(text):
        fake = root / program.lstrip("/")
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    done = subprocess.run(
        [ANALYZE, "verify", f"--root={root}", DCGM_UNIT], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
