"""CUDA version <-> NVIDIA driver branch: the one table every check of that pairing reads.

A CUDA runtime (the one torch was built with, or an image's) needs a driver at least as new as
the toolkit's minimum (NVIDIA CUDA Toolkit release notes, "CUDA Toolkit and Corresponding Driver
Versions", Linux x86_64, GA releases). Within one major version, CUDA *minor version
compatibility* lets a newer minor run on an older driver of the same major (no PTX JIT); across
major versions it does not: a CUDA 13.0 runtime on a 570 driver (which reports `CUDA Version:
12.8` in nvidia-smi's header) fails at CUDA init. Seed 003 §12 ran SGLang v0.5.17 in a CUDA 13.0
image; the default driver hgxserve installs (DRIVER_VERSION below) is 570.

    >>> min_driver_for("13.0")
    '580.65.06'
    >>> driver_branch_for("cu129")
    '575'
    >>> print(cuda_driver_problem("13.0", driver_cuda="12.8", driver_version="570.158.01"))
    ... # doctest: +ELLIPSIS
    CUDA 13.0 needs driver branch 580 or newer (>= 580.65.06); driver 570.158.01 supports CUDA ...
    >>> cuda_driver_problem("12.9", driver_cuda="12.8") is None   # minor version compatibility
    True
"""

from __future__ import annotations

import re

# The driver hgxserve installs unless provision is given another (`--data driver_version=...`):
# roles.nvidia_driver and roles.fabric_manager install exactly this version.
DRIVER_BRANCH = "570"
DRIVER_VERSION = "570.158.01"

# CUDA toolkit (major.minor, GA) -> minimum Linux x86_64 driver version.
CUDA_MIN_DRIVER: dict[str, str] = {
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
    "13.1": "590.44.01",
}

# Minor version compatibility: any CUDA <major>.x runs on a driver at least this new.
MAJOR_MIN_DRIVER: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

_CUDA = re.compile(r"^(?:cuda[-_ ]?)?(\d{1,2})(?:\.(\d{1,2})(?:\.\d+)?)?$", re.IGNORECASE)
_CU_TAG = re.compile(r"^cu(\d{2,3})$", re.IGNORECASE)
_DRIVER = re.compile(r"^\d{3}(?:\.\d{1,3}){1,2}$")


def parse_cuda(text: str) -> tuple[int, int]:
    """(major, minor) of a CUDA version as tools and tags write it: 12.9, 12.9.1, cu129, cuda13.0.

    >>> parse_cuda("cu129"), parse_cuda("12.8.93"), parse_cuda("cuda13.0")
    ((12, 9), (12, 8), (13, 0))
    """
    value = text.strip()
    tag = _CU_TAG.match(value)
    if tag:
        digits = tag.group(1)
        return int(digits[:2]), int(digits[2:] or 0)
    match = _CUDA.match(value)
    if not match:
        raise ValueError(f"not a CUDA version: {text!r} (expected e.g. 12.9 or cu129)")
    return int(match.group(1)), int(match.group(2) or 0)


def cuda_text(version: tuple[int, int]) -> str:
    """`12.9` for (12, 9)."""
    return f"{version[0]}.{version[1]}"


def parse_driver(text: str) -> tuple[int, ...]:
    """A driver version as a comparable tuple (570.158.01 -> (570, 158, 1)).

    >>> parse_driver("570.158.01") < parse_driver("580.65.06")
    True
    """
    value = text.strip()
    if not _DRIVER.match(value):
        raise ValueError(f"not an NVIDIA driver version: {text!r} (expected e.g. 570.158.01)")
    return tuple(int(part) for part in value.split("."))


def min_driver_for(cuda: str) -> str:
    """The minimum driver for a CUDA version's full support (its toolkit's GA minimum).

    A minor version newer than the table's newest of its major maps to that newest entry of the
    major; an unknown newer major raises ValueError.
    """
    version = parse_cuda(cuda)
    known = sorted(parse_cuda(k) for k in CUDA_MIN_DRIVER)
    candidates = [k for k in known if k <= version]
    if not candidates or candidates[-1][0] != version[0]:
        raise ValueError(f"CUDA {cuda_text(version)}: no driver minimum known for that version")
    return CUDA_MIN_DRIVER[cuda_text(candidates[-1])]


def driver_branch_for(cuda: str) -> str:
    """The driver branch (the version's first field) a CUDA version needs: `580` for 13.0."""
    return min_driver_for(cuda).split(".")[0]


def max_cuda_of_driver(driver_version: str) -> str | None:
    """The newest CUDA toolkit a driver fully supports, from the table (None: older than all).

    nvidia-smi prints this in its header (`CUDA Version: 12.8`); prefer that when it is known.

    >>> max_cuda_of_driver("570.158.01"), max_cuda_of_driver("550.144.03")
    ('12.8', '12.4')
    """
    driver = parse_driver(driver_version)
    best: tuple[int, int] | None = None
    for cuda, minimum in CUDA_MIN_DRIVER.items():
        version = parse_cuda(cuda)
        if parse_driver(minimum) <= driver and (best is None or version > best):
            best = version
    return cuda_text(best) if best else None


def cuda_driver_problem(
    runtime_cuda: str, *, driver_cuda: str | None = None, driver_version: str | None = None
) -> str | None:
    """Why a CUDA runtime cannot run on this driver, or None when it can.

    `driver_cuda` is nvidia-smi's header `CUDA Version` (the driver's own answer); without it
    the driver version is looked up in the table. A newer minor of the same major is allowed
    (CUDA minor version compatibility); a newer major needs the branch named in the message.
    """
    runtime = parse_cuda(runtime_cuda)
    if driver_cuda:
        supported: tuple[int, int] | None = parse_cuda(driver_cuda)
    elif driver_version:
        top = max_cuda_of_driver(driver_version)
        supported = parse_cuda(top) if top else None
    else:
        return None
    if supported is not None and runtime <= supported:
        return None
    if supported is not None and runtime[0] == supported[0]:
        floor = MAJOR_MIN_DRIVER.get(runtime[0])
        if floor is None or driver_version is None:
            return None
        if parse_driver(driver_version) >= parse_driver(floor):
            return None
    try:
        minimum = min_driver_for(cuda_text(runtime))
    except ValueError:
        minimum = MAJOR_MIN_DRIVER.get(runtime[0], "")
    branch = minimum.split(".")[0] if minimum else "newer"
    need = f"driver branch {branch} or newer (>= {minimum})" if minimum else "a newer driver"
    driver = f"driver {driver_version}" if driver_version else "the driver"
    top_text = cuda_text(supported) if supported else "none known"
    return f"CUDA {cuda_text(runtime)} needs {need}; {driver} supports CUDA up to {top_text}"
