"""The simulated engine's knobs (`HGXSERVE_SIM_*`) in a test topology's `env:` are outside the
engines' variable families, so validate refuses them (rule env-family) like any other name a
topology cannot justify. Tests that set them accept each one by its path, as a lab would:

    text = accept_simulation_env(text)
"""

from __future__ import annotations

from typing import Any

from ruamel.yaml import YAML

from hgxserve.topology.problems import format_path

WHY = "a knob of the simulated engine (testbed/simengine.py), set by this test"


def accept_simulation_env(text: str) -> str:
    """`text` with an `accept:` entry for every HGXSERVE_SIM_* variable its engines (or
    defaults) set; unchanged when there is none."""
    data: Any = YAML(typ="safe").load(text) or {}
    paths = []
    for where, block in [(("defaults",), data.get("defaults") or {})] + [
        (("engines", name), engine or {}) for name, engine in (data.get("engines") or {}).items()
    ]:
        for key in sorted(block.get("env") or {}):
            if key.startswith("HGXSERVE_SIM_"):
                paths.append(format_path((*where, "env", key)))
    if not paths:
        return text
    entries = "".join(f"  {path!r}: {WHY!r}\n" for path in paths)
    if "\naccept:\n" in text:
        return text.replace("\naccept:\n", "\naccept:\n" + entries, 1)
    return text.rstrip("\n") + "\naccept:\n" + entries
