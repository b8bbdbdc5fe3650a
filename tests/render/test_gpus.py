"""`hgxserve gpus check-free / wait-free / exec-with-credentials` with a fake nvidia-smi on PATH.

The fake prints the exact CSV shapes of `--query-gpu=index,uuid` and
`--query-compute-apps=gpu_uuid,pid,used_memory` with `--format=csv,noheader,nounits`; busy
processes come from a file the test writes (and empties, to model a process exiting).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT

HGXSERVE = str(ROOT / ".venv" / "bin" / "hgxserve")
UUIDS = [f"GPU-00000000-0000-0000-0000-00000000000{i}" for i in range(8)]

FAKE = """#!/bin/sh
case "$1" in
  --query-gpu=index,uuid) cat "$FAKE_SMI_DIR/gpus" ;;
  --query-compute-apps=gpu_uuid,pid,used_memory) cat "$FAKE_SMI_DIR/apps" ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
"""


@pytest.fixture
def smi(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(FAKE)
    (bindir / "nvidia-smi").chmod(0o755)
    (tmp_path / "gpus").write_text("".join(f"{i}, {u}\n" for i, u in enumerate(UUIDS)))
    (tmp_path / "apps").write_text("")
    return {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "FAKE_SMI_DIR": str(tmp_path)}


def run(env, *args, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HGXSERVE, "gpus", *args], env=env, capture_output=True, text=True, **kw)


def test_check_free_passes_on_idle_gpus(smi):
    done = run(smi, "check-free", "--gpus", "0,1,2,3")
    assert done.returncode == 0 and "are free" in done.stdout


def test_check_free_lists_pid_and_memory_of_busy_gpus(smi, tmp_path):
    (tmp_path / "apps").write_text(f"{UUIDS[5]}, 4242, 130215\n{UUIDS[1]}, 17, 512\n")
    done = run(smi, "check-free", "--gpus", "4,5,6,7")
    assert done.returncode == 1
    assert f"GPU 5 ({UUIDS[5]}) is busy: pid 4242 uses 130215 MiB" in done.stderr
    assert "pid 17" not in done.stderr  # GPU 1 is not one of ours
    assert run(smi, "check-free", "--gpus", "0,2").returncode == 0


def test_missing_gpu_and_missing_tool_are_clear_errors(smi):
    done = run(smi, "check-free", "--gpus", "0,9")
    assert done.returncode == 2 and "GPU 9 not present on this host (present: 0,1" in done.stderr
    no_tool = {**smi, "PATH": "/nonexistent"}
    done = run(no_tool, "check-free", "--gpus", "0")
    assert "nvidia-smi not found" in done.stderr and "Traceback" not in done.stderr
    assert run(smi, "check-free", "--gpus", "a,b").returncode == 2


def test_wait_free_returns_when_the_process_exits(smi, tmp_path):
    apps = tmp_path / "apps"
    apps.write_text(f"{UUIDS[0]}, 4242, 90000\n")
    proc = subprocess.Popen(
        [HGXSERVE, "gpus", "wait-free", "--gpus", "0", "--timeout", "20", "--interval", "0.1"],
        env=smi, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(1.0)
    assert proc.poll() is None  # still waiting while GPU 0 is busy
    apps.write_text("")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "are free" in out


def test_wait_free_times_out_with_the_busy_list(smi, tmp_path):
    (tmp_path / "apps").write_text(f"{UUIDS[2]}, 99, 1024\n")
    start = time.monotonic()
    done = run(smi, "wait-free", "--gpus", "2", "--timeout", "0.5", "--interval", "0.1")
    assert done.returncode == 1 and time.monotonic() - start < 10
    assert "pid 99 uses 1024 MiB" in done.stderr and "after 0.5 s" in done.stderr


def test_exec_with_credentials_exports_from_credentials_directory(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "hf-token").write_text("hf_value_123\n")
    env = {**os.environ, "CREDENTIALS_DIRECTORY": str(creds)}
    done = subprocess.run(
        [HGXSERVE, "gpus", "exec-with-credentials", "HF_TOKEN=hf-token", "--",
         "/bin/sh", "-c", 'printf "%s" "$HF_TOKEN"'],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "hf_value_123"
    missing = subprocess.run(
        [HGXSERVE, "gpus", "exec-with-credentials", "X=nope", "--", "/bin/true"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "cannot read credential 'nope' for X" in missing.stderr
    unset = {k: v for k, v in env.items() if k != "CREDENTIALS_DIRECTORY"}
    done = subprocess.run(
        [HGXSERVE, "gpus", "exec-with-credentials", "X=a", "--", "/bin/true"],
        env=unset, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and "CREDENTIALS_DIRECTORY is not set" in done.stderr
