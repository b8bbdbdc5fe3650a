"""The SIMULATED ib_write_bw of the test hosts (testbed/fakes/ib_write_bw.py): a server and a
client really talk over TCP, both print perftest's report (which the product's parser reads),
and the faults the e2e test injects show: a port that is down, half bandwidth."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hgxserve.parsers.fabric import parse_ib_write_bw

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "testbed/fakes/ib_write_bw.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host(tmp_path: Path, name: str, state: str = "4: ACTIVE", faults: str = "") -> Path:
    """A simulated host's sysfs and fault file under tmp_path/name."""
    port = tmp_path / name / "sysfs/mlx5_0/ports/1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (tmp_path / name / "faults").write_text(faults)
    return tmp_path / name


def _run(root: Path, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "HGXSERVE_SIM_RDMA_DIR": str(root / "sysfs"),
        "HGXSERVE_SIM_FABRIC_FAULTS": str(root / "faults"),
    }
    return subprocess.Popen(
        [sys.executable, str(FAKE), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _pair(tmp_path: Path, server_faults: str = "", server_state: str = "4: ACTIVE"):
    port = _free_port()
    args = ("-d", "mlx5_0", "-p", str(port), "-F", "--report_gbits")
    server = _run(_host(tmp_path, "b", server_state, server_faults), *args)
    time.sleep(0.5)
    client = _run(_host(tmp_path, "a"), *args, "127.0.0.1")
    c_out, c_err = client.communicate(timeout=30)
    s_out, s_err = server.communicate(timeout=30)
    return client.returncode, c_out, c_err, server.returncode, s_out, s_err


def test_a_healthy_pair_reports_97_percent_of_the_rail_on_both_ends(tmp_path: Path) -> None:
    c_rc, c_out, _, s_rc, s_out, _ = _pair(tmp_path)
    assert (c_rc, s_rc) == (0, 0)
    for out in (c_out, s_out):
        report = parse_ib_write_bw(out.splitlines())
        assert report is not None and report.average_gbps == pytest.approx(388.0, abs=0.01)
        assert " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]" in out


def test_half_bandwidth_on_the_server_host_halves_the_clients_figure(tmp_path: Path) -> None:
    c_rc, c_out, _, _, _, _ = _pair(tmp_path, server_faults="bw_factor: 0.5\n")
    report = parse_ib_write_bw(c_out.splitlines())
    assert c_rc == 0 and report is not None
    assert report.average_gbps == pytest.approx(194.0, abs=0.01)


def test_a_port_down_stops_its_end_as_perftest_does(tmp_path: Path) -> None:
    c_rc, c_out, c_err, s_rc, _, s_err = _pair(tmp_path, server_state="1: DOWN")
    assert s_rc == 1 and s_err.strip() == "Port number 1 state is Down"
    assert c_rc == 1 and "Couldn't connect to 127.0.0.1:" in c_err
    assert parse_ib_write_bw(c_out.splitlines()) is None
