"""Small shared pieces of the test-host harness: errors, progress output, command runs.

Example::

    run(["ip", "link", "show", "br-hgx"], check=False)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


class TestbedError(RuntimeError):
    """A test-host problem with a message meant for the person running the harness."""

    __test__ = False  # not a pytest test class despite the name


def say(message: str) -> None:
    """Print one progress line on stderr.

    Example: ``say("booting hgx-a")`` prints ``testbed: booting hgx-a`` (in lab 2, set by
    testbed/lab.py: ``testbed: lab 2: booting hgx-a``)
    """
    lab = os.environ.get("HGXSERVE_LAB", "0")
    where = f"lab {lab}: " if lab not in ("", "0") else ""
    print(f"testbed: {where}{message}", file=sys.stderr, flush=True)


def run(
    cmd: Sequence[str], *, check: bool = True, input_text: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output, and raise TestbedError with stderr when it fails.

    Example: ``run(["ip", "netns", "add", "hgxtb-a"])``
    """
    try:
        proc = subprocess.run(
            list(cmd),
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise TestbedError(f"command not found: {cmd[0]}") from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise TestbedError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {detail}")
    return proc
