"""The tune's state file, `state.json` in its run directory: written whole to a temporary file,
flushed and renamed over the old one (atomic), after every step.

Each candidate moves `pending` -> `deploying` -> `benching` -> `done`, or ends `failed` (its
release or bench failed, with the reason) or `pruned` (before any deploy, with every reason). A
resumed tune skips `done`, `failed` and `pruned` candidates and runs a `deploying` or `benching`
one again (the tune stopped in the middle of it); `attempts` counts its deploys.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hgxserve.base.errors import UsageError
from hgxserve.base.versioned import read_versioned

STATE_FILE = "state.json"
SCHEMA_VERSION = 1
FINISHED = ("done", "failed", "pruned")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_state(spec_file: str, spec_digest: str) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "spec": spec_file,
        "spec_digest": spec_digest,
        "started": now(),
        "candidates": {},  # name -> record, in the order they run
        "final": None,
        "pid": os.getpid(),
    }


def add_candidate(state: dict[str, Any], name: str, file: str, **fields: Any) -> dict[str, Any]:
    """The candidate's record; an existing one (a resumed tune) is kept as it was."""
    record = state["candidates"].get(name)
    if record is None:
        record = {
            "name": name,
            "file": file,
            "status": "pending",
            "reasons": [],
            "attempts": 0,
            "release": None,
            "bench_run": None,
            "verdict": None,
            "score": None,
            **fields,
        }
        state["candidates"][name] = record
    return record


def to_run(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Candidates still to deploy and bench, in order."""
    return [r for r in state["candidates"].values() if r["status"] not in FINISHED]


def save(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(state, indent=2, sort_keys=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def load(run_dir: Path, spec_digest: str | None = None) -> dict[str, Any]:
    """A kept tune's state; UsageError when it is not one, or was run from another SPEC."""
    state = read_versioned(run_dir / STATE_FILE, SCHEMA_VERSION, "tune run", "tune state")
    if spec_digest is not None and state.get("spec_digest") != spec_digest:
        raise UsageError(
            f"{run_dir}: was run from another SPEC (or the SPEC changed since): start a new tune"
        )
    return state


def unfinished(out_root: Path, spec_digest: str) -> Path | None:
    """The latest run under out_root of the same SPEC that has not finished, if any."""
    if not out_root.is_dir():
        return None
    for run_dir in sorted(out_root.iterdir(), reverse=True):
        try:
            state = load(run_dir, spec_digest)
        except UsageError:
            continue
        if state.get("final") is None:
            return run_dir
    return None
