"""pyinfra fact about a model tree's verification: its marker, state record and a stat-only
marker check by the agent.

Example:
    >>> host.get_fact(ModelManifestState, dest="/models/x")  # doctest: +SKIP
    {'marker': 'sha256:9f2c...', 'source': 's3://models/x/', 'manifest_digest':
     'sha256:9f2c...', 'files': 55, 'check': 'ok'}
"""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra.api import FactBase

from hgxserve.base.paths import AGENT
from hgxserve.parsers.probes import parse_manifest_state
from hgxserve.weights.state import STATE_DIR_NAME


class ModelManifestState(FactBase):
    """The marker, the state record's source/digest, and a stat-only marker check of a tree.

    Example:
        >>> host.get_fact(ModelManifestState, dest="/models/x")  # doctest: +SKIP
        {'marker': 'sha256:9f2c...', 'source': 's3://models/x/', 'manifest_digest':
         'sha256:9f2c...', 'files': 55, 'check': 'ok'}
    """

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

    @staticmethod
    def default() -> dict[str, Any]:
        return {}

    def process(self, output: list[str]) -> dict[str, Any]:
        return parse_manifest_state(output)
