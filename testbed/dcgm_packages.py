"""Stand-in `.deb` packages of NVIDIA's DCGM and DCGM exporter for the test hosts (SIMULATED).

There is no GPU and no NVIDIA repository here. So that the monitoring stage installs the DCGM
exporter on test hosts the way it does on real ones (apt-get from the hosts' apt sources, at the
pinned versions, then held), this builds packages under the real names and versions
(hgxserve.monitoring.host_files.DCGM_PACKAGES) into a flat apt repository:

- datacenter-gpu-manager-4-core: empty (the DCGM library the real exporter links against);
- datacenter-gpu-manager-exporter: the SIMULATED exporter (testbed/fakes/dcgm_exporter.py) at the
  real binary path /usr/bin/dcgm-exporter, and a copy of the real package's
  nvidia-dcgm-exporter.service (NVIDIA/dcgm-exporter packaging/config-files/systemd), which the
  stage keeps stopped.

Example::

    repo = build_repo(Path("/tmp/work"))   # repo/Packages + repo/*.deb
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from hgxserve.monitoring.host_files import DCGM_PACKAGES, DCGM_VENDOR_UNIT

FAKES = Path(__file__).resolve().parent / "fakes"
# The package versions as NVIDIA's repository spells them (epoch for DCGM, package revision).
DEB_VERSIONS = {
    "datacenter-gpu-manager-4-core": "1:{version}-1",
    "datacenter-gpu-manager-exporter": "{version}.002-1",
}
VENDOR_UNIT = """\
[Unit]
Description=NVIDIA DCGM-exporter service
Wants=nvidia-dcgm.service
After=nvidia-dcgm.service

[Service]
User=root
PrivateTmp=false
StandardOutput=append:/var/dcgm-exporter.log
StandardError=append:/var/dcgm-exporter.log
ExecStart=/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/default-counters.csv
Restart=on-abort

[Install]
WantedBy=multi-user.target
"""


def _control(name: str, version: str, depends: str = "") -> str:
    return (
        f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: hgxserve testbed <tests@hgxserve.invalid>\n"
        + (f"Depends: {depends}\n" if depends else "")
        + f"Description: SIMULATED stand-in for NVIDIA's {name} (hgxserve test hosts)\n"
    )


def build_repo(work: Path) -> Path:
    """Build the stand-in packages and a flat repo index under `work/repo`; return it."""
    repo = work / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    versions = {name: DEB_VERSIONS[name].format(version=v) for name, v in DCGM_PACKAGES}
    for name, version in versions.items():
        tree = work / "build" / name
        (tree / "DEBIAN").mkdir(parents=True, exist_ok=True)
        depends = ""
        if name == "datacenter-gpu-manager-exporter":
            core = "datacenter-gpu-manager-4-core"
            depends = f"{core} (= {versions[core]})"
            exporter = tree / "usr/bin/dcgm-exporter"
            exporter.parent.mkdir(parents=True, exist_ok=True)
            exporter.write_bytes((FAKES / "dcgm_exporter.py").read_bytes())
            exporter.chmod(0o755)
            unit = tree / "lib/systemd/system" / DCGM_VENDOR_UNIT
            unit.parent.mkdir(parents=True, exist_ok=True)
            unit.write_text(VENDOR_UNIT)
        (tree / "DEBIAN/control").write_text(_control(name, version, depends))
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-b", str(tree), str(repo / f"{name}.deb")],
            check=True,
            capture_output=True,
        )
    index = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (repo / "Packages").write_text(index)
    return repo
