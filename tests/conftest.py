"""The whole suite: each pytest-xdist worker in a lab of its own, work handed out by lab cost.

**Labs.** A worker (``pytest -n N``) locks the first free lab >= 1 and enters its network
namespace (testbed/lab.py) before any test module is imported, so its test hosts, bridge, local
S3, state directory and every port it opens on 127.0.0.1 are its own, at the addresses every
topology names. A run without xdist stays in lab 0 (the machine's own namespace), as a plain
``pytest tests/e2e/test_x.py`` always did; ``HGXSERVE_LAB=L`` runs it in lab L instead.

**Grouping and order** (``--dist loadfile``, scripts/test.sh). Every module is one work unit,
so tests that build on each other and a module fixture that deploys the lab stay in one
worker, on one lab. Units are handed out most expensive first (``COST_S``, measured): the
longest e2e modules start at once and the cheap ones fill the gaps. A worker's later modules
find what its earlier ones installed on its lab (runtimes, agent), as in a serial run.
(``--dist loadgroup`` would allow other groupings, but pytest-xdist 3.8 marks a group by
rewriting ``Item._nodeid``, which pytest 9.2 no longer reads.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testbed import lab  # noqa: E402  (imports only the standard library and testbed.util)


def _enter_lab() -> int | None:
    """Lock and enter this process's lab; None when it stays where it started (lab 0)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    pinned = os.environ.get("HGXSERVE_LAB", "")
    if worker is None and pinned in ("", "0"):
        return None
    if os.geteuid() != 0 or not shutil.which("ip"):
        return None  # no e2e test can run here anyway (tests/e2e/conftest.py says why)
    # a worker takes the first free lab; HGXSERVE_LAB pins a run without xdist to one
    index = lab.acquire(None if worker is not None else int(pinned))
    lab.enter(index)
    return index


# Before any other conftest or test module imports testbed.hosts, which reads the lab's state
# directory when imported.
LAB = _enter_lab()

# Wall time of each module on a 2-core machine, seconds (one whole serial run of the suite on
# 2026-12-07; scripts/test.sh prints the slowest tests of every run). What is not listed costs
# less than a minute. Only the order of the work depends on these.
COST_S: dict[str, float] = {
    "tests/e2e/test_release.py": 512,
    "tests/e2e/test_bench.py": 369,
    "tests/e2e/test_images.py": 179,
    "tests/e2e/test_tune.py": 166,
    "tests/e2e/test_drain.py": 146,
}


@pytest.fixture
def matplotlib_extra() -> None:
    """Skip, naming the extra, where the [bench] extra's matplotlib is not installed."""
    pytest.importorskip("matplotlib", reason="the [bench] extra (matplotlib) is not installed")


@pytest.fixture
def aiperf_installed() -> None:
    """Skip where AIPerf, the bench's load generator (its own venv), is not installed."""
    from hgxserve.bench.generator import GeneratorError, aiperf_command

    try:
        aiperf_command()
    except GeneratorError as exc:
        pytest.skip(str(exc))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the most expensive module first; within one, the collection's order
    (tests build on it). Every worker sorts its identical collection the same way, and
    ``--dist loadfile --no-loadscope-reorder`` hands the modules out in this order."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    first = {module: i for i, module in enumerate(dict.fromkeys(map(_module, items)))}
    items.sort(key=lambda it: (-COST_S.get(_module(it), 0.0), first[_module(it)]))


# HGXSERVE_TEST_TIMELINE=FILE: each worker appends one JSON line per module it ran (worker, lab,
# module, start and end in wall-clock seconds), to see how the labs were kept busy.
_TIMELINE: dict[str, list[float]] = {}


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if os.environ.get("HGXSERVE_TEST_TIMELINE"):
        span = _TIMELINE.setdefault(nodeid.split("::", 1)[0], [time.time(), time.time()])
        span[1] = time.time()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    span = _TIMELINE.get(nodeid.split("::", 1)[0])
    if span is not None:
        span[1] = time.time()


def _write_timeline(config: pytest.Config) -> None:
    path = os.environ.get("HGXSERVE_TEST_TIMELINE")
    if not path or not _TIMELINE or config.getoption("dist", "no") != "no":
        return  # xdist's controller sees every worker's reports: only the workers write
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(path, "a", encoding="utf-8") as fh:
        for module, (start, end) in _TIMELINE.items():
            row = {"worker": worker, "lab": LAB, "module": module, "start": start, "end": end}
            fh.write(json.dumps(row) + "\n")


def pytest_report_header(config: pytest.Config) -> str | None:
    if LAB is None:
        return None
    return f"lab {LAB}: network namespace {lab.netns(LAB)}, state {lab.state_dir(LAB)}"


def pytest_unconfigure(config: pytest.Config) -> None:
    """A lab whose hosts are gone (torn down by the e2e session fixture) goes too."""
    _write_timeline(config)
    if LAB is None or LAB == 0:
        return
    if (lab.state_dir(LAB) / "state.json").exists():
        return  # hosts kept (HGXSERVE_KEEP_TESTBED=1): the next run that locks LAB reuses them
    lab.leave_and_remove(LAB)
