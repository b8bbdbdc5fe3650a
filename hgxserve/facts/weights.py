"""pyinfra facts about a model tree: its verification (marker, state record and a stat-only
marker check by the agent) and the total size its manifest lists.

Example:
    >>> host.get_fact(ModelManifestState, dest="/models/x")  # doctest: +SKIP
    {'marker': 'sha256:9f2c...', 'source': 's3://models/x/', 'manifest_digest':
     'sha256:9f2c...', 'files': 55, 'check': 'ok'}
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from hgxserve.base.paths import AGENT
from hgxserve.facts.common import Fact
from hgxserve.parsers.probes import parse_manifest_state
from hgxserve.weights.state import STATE_DIR_NAME

_MANIFEST_HEAD = "##manifest "


class ModelManifestState(Fact):
    """The marker, the state record's source/digest, and a stat-only marker check of a tree.

    Example:
        >>> host.get_fact(ModelManifestState, dest="/models/x")  # doctest: +SKIP
        {'marker': 'sha256:9f2c...', 'source': 's3://models/x/', 'manifest_digest':
         'sha256:9f2c...', 'files': 55, 'check': 'ok'}
    """

    empty = {}

    def command(self, dest: str, state_dir: str | None = None, agent: str = AGENT) -> str:
        directory = state_dir or f"{dest.rstrip('/')}/{STATE_DIR_NAME}"
        d, a = shlex.quote(directory), shlex.quote(agent)
        check = f"{a} weights check-marker {shlex.quote(dest)} -q"
        if state_dir:
            check += f" --state-dir {d}"
        # The agent may not be installed yet on a fresh host: then the check says "absent".
        return (
            f"echo '##marker'; cat {d}/verified 2>/dev/null; "
            f"echo '##state'; cat {d}/state.json 2>/dev/null; "
            f"echo '##check'; if [ -x {a} ]; then {check} >/dev/null 2>&1 "
            "&& echo ok || echo stale; else echo absent; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        return parse_manifest_state(output)


class ManifestSize(Fact):
    """The bytes the manifest already on the host lists for the tree at `dest`: the tree's own
    manifest file (`manifest`, hgxserve-manifest.json by default) or the copy a sync keeps in its
    state directory. `None` when neither is there or readable.

    Example:
        >>> host.get_fact(ManifestSize, dest="/models/x", manifest="hgxserve-manifest.json")
        ... # doctest: +SKIP
        {'bytes': 740881858560, 'files': 163, 'file': '/models/x/hgxserve-manifest.json'}
    """

    empty = {"bytes": None, "files": 0, "file": None}

    def command(self, dest: str, manifest: str) -> str:
        base = dest.rstrip("/")
        candidates = [f"{base}/{manifest}", f"{base}/{STATE_DIR_NAME}/manifest.json"]
        quoted = " ".join(shlex.quote(path) for path in candidates)
        return (
            f'for f in {quoted}; do if [ -f "$f" ] && [ -r "$f" ]; then '
            f'echo "{_MANIFEST_HEAD}$f"; cat "$f"; echo; break; fi; done; true'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        return manifest_size(output)


def manifest_size(lines: list[str]) -> dict[str, Any]:
    """ManifestSize's value from its output: the sum of the listed files' sizes.

    Example:
        >>> manifest_size(["##manifest /m/x.json", '{"files": [{"path": "a", "size": 3}]}'])
        {'bytes': 3, 'files': 1, 'file': '/m/x.json'}
    """
    result = ManifestSize.default()
    if not lines or not lines[0].startswith(_MANIFEST_HEAD):
        return result
    try:
        body = json.loads("\n".join(lines[1:]))
        sizes = [int(entry["size"]) for entry in body["files"]]
    except (ValueError, KeyError, TypeError):
        return result
    if any(size < 0 for size in sizes):
        return result
    return {"bytes": sum(sizes), "files": len(sizes), "file": lines[0][len(_MANIFEST_HEAD) :]}
