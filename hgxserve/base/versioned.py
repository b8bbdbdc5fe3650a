"""A JSON record that hgxserve keeps and reads back (a bench run, a tune's state), by version.

>>> import json, tempfile
>>> path = Path(tempfile.mkdtemp()) / "run.json"
>>> _ = path.write_text(json.dumps({"schema_version": 1, "passed": True}))
>>> read_versioned(path, 1, "bench run", "bench run")["passed"]
True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hgxserve.base.errors import UsageError


def read_versioned(path: Path, schema_version: int, unreadable: str, other: str) -> dict[str, Any]:
    """The JSON object at `path`, of `schema_version`. UsageError "PATH: not a {unreadable}
    (why)" when it cannot be read or parsed, "PATH: not a {other} of schema version N" when it
    is not such an object."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a {unreadable} ({exc})") from None
    if not isinstance(data, dict) or data.get("schema_version") != schema_version:
        raise UsageError(f"{path}: not a {other} of schema version {schema_version}")
    return data
