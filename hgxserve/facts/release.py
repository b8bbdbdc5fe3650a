"""pyinfra fact about a host's release store: its links, a pending switch, stopped units.

Example:
    >>> host.get_fact(ReleaseState)  # doctest: +SKIP
    {'current': '3f1c9a2b7d10', 'previous': None, 'baseline': None, 'pending': None}
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from pyinfra.api import FactBase

from hgxserve.base.paths import RELEASE_ROOT


class ReleaseState(FactBase[dict[str, Any]]):
    """Links and pending switch of the host's release store, read without the agent.

    Returns ``{"current": id, "previous": id, "baseline": id, "pending": {...}}`` (None if unset).
    """

    def command(self, root: str = RELEASE_ROOT) -> str:
        r = shlex.quote(root)
        return (
            f"for l in current previous baseline; do "
            f'id="$(basename "$(readlink {r}/$l 2>/dev/null)" 2>/dev/null)"; '
            f'printf "%s=%s\\n" "$l" "$id"; '
            f'if [ -n "$id" ] && grep -q \'"gate": {{\' {r}/$l/release.json 2>/dev/null; '
            f'then echo "gate_$l=yes"; fi; '
            f"done; printf 'pending='; cat {r}/pending.json 2>/dev/null | tr -d '\\n'; echo; "
            # units of the current release that are not running (drift: stopped, crashed)
            f'for u in $(sed -n \'s/^ *"name": "\\(hgxserve-[^"]*\\)",*$/\\1/p\' '
            f"{r}/current/release.json 2>/dev/null); do "
            f'systemctl is-active --quiet "$u" || echo "inactive=$u"; done'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        data: dict[str, Any] = {
            "current": None,
            "previous": None,
            "baseline": None,
            "pending": None,
        }
        for line in output:
            key, _, value = line.partition("=")
            if key in ("current", "previous", "baseline"):
                data[key] = value.strip() or None
            elif key.startswith("gate_"):
                data[key] = value.strip() == "yes"  # the release at that link runs the gate
            elif key == "pending" and value.strip():
                data["pending"] = json.loads(value)
            elif key == "inactive":
                data.setdefault("inactive", []).append(value.strip())
        return data
