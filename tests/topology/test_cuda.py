"""The CUDA <-> driver table against the real nvidia-smi headers in tests/fixtures."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from hgxserve.parsers import outputs as parsers
from hgxserve.topology import cuda

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "real"
TABLES = [
    "h200_nvidia-smi.txt",
    "h20-3e_nvidia-smi.txt",
    "h200_1gpu-vm_nvidia-smi.txt",
    "h100_nvidia-smi.txt",
    "h20_1gpu-vm_nvidia-smi.txt",
    "h20_nvidia-smi_mig.txt",
]


def test_doctests() -> None:
    assert doctest.testmod(cuda).failed == 0


@pytest.mark.parametrize("name", TABLES)
def test_table_agrees_with_real_headers(name: str) -> None:
    text = (FIXTURES / name).read_text()
    parsed = parsers.parse_smi_table(text)
    driver, header_cuda = parsed["driver_version"], parsed["cuda_version"]
    top = cuda.max_cuda_of_driver(driver)
    # 565 reports 12.7, a CUDA version with no toolkit of its own: the table's answer is 12.6
    assert top == header_cuda or (header_cuda, top) == ("12.7", "12.6")
    assert cuda.cuda_driver_problem(header_cuda, driver_cuda=header_cuda) is None


@pytest.mark.parametrize(
    ("runtime", "driver_cuda", "driver", "expected"),
    [
        (
            "13.0",
            "12.8",
            "570.158.01",
            "CUDA 13.0 needs driver branch 580 or newer (>= 580.65.06); "
            "driver 570.158.01 supports CUDA up to 12.8",
        ),
        (
            "cu130",
            "12.4",
            "550.144.03",
            "CUDA 13.0 needs driver branch 580 or newer (>= 580.65.06); "
            "driver 550.144.03 supports CUDA up to 12.4",
        ),
        ("13.1", "13.0", "580.95.05", None),  # minor version compatibility within 13
        ("12.9", "12.8", "570.158.01", None),
        ("12.4", "12.8", "570.158.01", None),
        (
            "12.1",
            "11.8",
            "520.61.05",
            "CUDA 12.1 needs driver branch 530 or newer (>= 530.30.02); "
            "driver 520.61.05 supports CUDA up to 11.8",
        ),
        (
            "13.0",
            None,
            "570.158.01",
            "CUDA 13.0 needs driver branch 580 or newer (>= 580.65.06); "
            "driver 570.158.01 supports CUDA up to 12.8",
        ),
        ("13.0", None, None, None),
    ],
)
def test_problem(
    runtime: str, driver_cuda: str | None, driver: str | None, expected: str | None
) -> None:
    assert (
        cuda.cuda_driver_problem(runtime, driver_cuda=driver_cuda, driver_version=driver)
        == expected
    )


@pytest.mark.parametrize("bad", ["", "twelve", "12.x", "1234.5", "cu1"])
def test_refuses_what_is_not_a_cuda_version(bad: str) -> None:
    with pytest.raises(ValueError, match="not a CUDA version"):
        cuda.parse_cuda(bad)


def test_unknown_major_has_no_minimum() -> None:
    with pytest.raises(ValueError, match="no driver minimum"):
        cuda.min_driver_for("14.0")
    assert cuda.driver_branch_for("12.7") == "560"
    with pytest.raises(ValueError, match="not an NVIDIA driver version"):
        cuda.parse_driver("570")
