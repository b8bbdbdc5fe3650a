"""Runtime facts: the driver's CUDA from real nvidia-smi headers, and the venv probe run for
real against a Python with a torch-shaped package (version.py as torch writes it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hgxserve.facts.runtime import (
    CdiSpecState,
    ContainerImage,
    DriverCuda,
    HostPython,
    VenvRuntimeState,
)
from hgxserve.parsers.probes import driver_cuda_from_lines, venv_state_from_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"
VENV = str(Path(sys.executable).parent.parent)


@pytest.mark.parametrize(
    ("name", "driver", "cuda"),
    [
        ("h200_nvidia-smi.txt", "570.158.01", "12.8"),
        ("h20-3e_nvidia-smi.txt", "550.144.03", "12.4"),
        ("h100_nvidia-smi.txt", "565.57.01", "12.7"),
        ("h200_1gpu-vm_nvidia-smi.txt", "550.90.12", "12.4"),
    ],
)
def test_driver_cuda_from_real_headers(name: str, driver: str, cuda: str) -> None:
    lines = (FIXTURES / name).read_text().splitlines()[1:9]  # after the `# source:` line
    assert driver_cuda_from_lines([*lines, "##rc 0"]) == {
        "status": "ok", "driver_version": driver, "cuda_version": cuda,
    }  # fmt: skip


def test_driver_cuda_absent_and_failing() -> None:
    assert driver_cuda_from_lines(["##absent"])["status"] == "absent"
    failed = driver_cuda_from_lines(
        ["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "##rc 9"]
    )
    assert failed["status"] == "error" and "couldn't communicate" in failed["error"]


def _run(command: str, pythonpath: Path | None = None) -> list[str]:
    prefix = f"export PYTHONPATH={pythonpath}; " if pythonpath else ""
    proc = subprocess.run(["sh", "-c", prefix + command], capture_output=True, text=True)
    return proc.stdout.splitlines()


def test_venv_probe_reads_versions_imports_and_torch_cuda(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "torch" / "version.py").write_text(
        "__version__ = '2.9.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
        "hip: Optional[str] = None\n"
    )
    info = site / "torch-2.9.0+cu130.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0+cu130\n")
    command = VenvRuntimeState().command(VENV, "pyinfra", ("json", "nixl._api"))
    state = venv_state_from_lines(_run(command, site))
    assert state["present"] is True
    assert state["engine_version"] and state["torch_version"] == "2.9.0+cu130"
    assert state["torch_cuda"] == "13.0"
    assert state["imports"] == {
        "json": "ok",
        "nixl._api": "ModuleNotFoundError: No module named 'nixl'",
    }
    assert state["marker"] is None
    missing = VenvRuntimeState().command(str(tmp_path / "none"), "vllm", ())
    assert venv_state_from_lines(_run(missing)) == {"present": False}


def test_small_facts() -> None:
    assert HostPython().process(["3.11 x86_64 2.36"]) == {
        "version": "3.11", "machine": "x86_64", "glibc": "2.36",
    }  # fmt: skip
    assert HostPython().process(["absent"])["version"] is None
    assert CdiSpecState().process(["present", "570.158.01"]) == {
        "present": True, "driver": "570.158.01",
    }  # fmt: skip
    assert CdiSpecState().process(["absent"]) == {"present": False, "driver": None}
    digest = "sha256:" + "a" * 64
    assert ContainerImage().process(["tool", digest]) == {"tool": True, "digest": digest}
    assert ContainerImage().process(["tool"]) == {"tool": True, "digest": None}
    assert ContainerImage().process(["notool"]) == {"tool": False, "digest": None}
    assert "nvidia-smi" in DriverCuda().command()
