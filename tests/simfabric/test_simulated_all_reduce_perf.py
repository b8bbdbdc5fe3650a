"""The SIMULATED nccl-tests all_reduce_perf and mpirun of the test hosts
(testbed/fakes/all_reduce_perf.py, mpirun.py): mpirun starts the ranks, they meet over TCP, rank
0 prints nccl-tests' format (which the product's parser reads), with the hosts' rails in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hgxserve.parsers.fabric import parse_all_reduce_perf

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "testbed/fakes"


def _run(tmp_path: Path, state: str = "4: ACTIVE", faults: str = "") -> subprocess.CompletedProcess:
    for rail in ("mlx5_0", "mlx5_1"):
        port = tmp_path / "sysfs" / rail / "ports/1"
        port.mkdir(parents=True, exist_ok=True)
        (port / "state").write_text((state if rail == "mlx5_1" else "4: ACTIVE") + "\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (tmp_path / "faults").write_text(faults)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("all_reduce_perf", "ib_write_bw"):
        shutil.copy(
            FAKES / f"{tool}.py", bin_dir / (tool if tool == "all_reduce_perf" else f"{tool}.py")
        )
    (bin_dir / "all_reduce_perf").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HGXSERVE_SIM_RDMA_DIR": str(tmp_path / "sysfs"),
        "HGXSERVE_SIM_FABRIC_FAULTS": str(tmp_path / "faults"),
    }
    argv = [sys.executable, str(FAKES / "mpirun.py"), "--allow-run-as-root", "-np", "2"]
    argv += ["-H", "127.0.0.1:2", "-x", "NCCL_IB_HCA=mlx5_0,mlx5_1"]
    argv += ["all_reduce_perf", "-b", "256M", "-e", "256M", "-g", "4"]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)


@pytest.mark.parametrize(
    ("state", "faults", "busbw"),
    [
        ("4: ACTIVE", "", 92.0),  # 2 x 400 Gb/s at 92%, in GB/s
        ("1: DOWN", "", 46.0),  # NCCL leaves the port that is down out
        ("4: ACTIVE", "bw_factor: 0.5\n", 46.0),
    ],
)
def test_the_bus_bandwidth_follows_the_rails(
    tmp_path: Path, state: str, faults: str, busbw: float
) -> None:
    proc = _run(tmp_path, state, faults)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = parse_all_reduce_perf(proc.stdout.splitlines())
    assert report.avg_busbw == pytest.approx(busbw) and report.out_of_bounds == 0
    assert proc.stdout.count("#  Rank ") == 8  # 2 processes x 4 GPUs


def test_a_rank_that_fails_aborts_the_job_as_open_mpi_says() -> None:
    argv = [sys.executable, str(FAKES / "mpirun.py"), "-np", "1", "-H", "127.0.0.1:1"]
    proc = subprocess.run(
        [*argv, sys.executable, str(FAKES / "all_reduce_perf.py"), "-q", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "mpirun detected that one or more processes exited with non-zero status" in proc.stdout
    assert parse_all_reduce_perf(proc.stdout.splitlines()).avg_busbw is None
