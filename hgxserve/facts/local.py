"""Collect HOST_FACTS on this machine by running each fact's own command locally.

Used by `hgxserve facts` on hosts (the agent, debugging); pyinfra runs the same commands over
SSH, so both paths parse identical output.

Example:
    >>> collect(["os"])["os"]["ID"]  # doctest: +SKIP
    'debian'
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from hgxserve.facts import HOST_FACTS

DEFAULT_MODEL_PATH = "/models"


def run_fact(name: str, model_path: str = DEFAULT_MODEL_PATH, timeout: float = 60) -> Any:
    """Run one fact's command through `sh -c` and process its stdout like pyinfra would.

    Example:
        >>> run_fact("peermem")  # doctest: +SKIP
        False
    """
    fact = HOST_FACTS[name]()
    kwargs = {"path": model_path} if name == "disk" else {}
    required = fact.requires_command(**kwargs)
    if required and shutil.which(required) is None:
        return fact.default()
    command = str(fact.command(**kwargs))
    proc = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip(), "rc": proc.returncode}
    lines = proc.stdout.splitlines()
    return fact.process(lines) if lines else fact.default()


def collect(names: list[str] | None = None, model_path: str = DEFAULT_MODEL_PATH) -> dict[str, Any]:
    """Collect the named facts (all of HOST_FACTS by default) into one dict.

    Example:
        >>> sorted(collect(["os", "shm"]))  # doctest: +SKIP
        ['os', 'shm']
    """
    out: dict[str, Any] = {}
    for name in names or list(HOST_FACTS):
        try:
            out[name] = run_fact(name, model_path)
        except subprocess.TimeoutExpired:
            out[name] = {"error": "timed out"}
    return out
