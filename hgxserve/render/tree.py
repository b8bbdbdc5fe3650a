"""`hgxserve render`'s output: one host's files written under a directory (paths below it mirror
the host), each atomically with its mode; a re-render removes what it no longer renders.

    write_tree(Path("build/render/h20-a"), render_host(topo, "h20-a"))
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hgxserve.render import HostRender

# Files written by the last render of a host tree, so a re-render removes what it no longer has.
MANIFEST = ".hgxserve-render.json"


def write_tree(out: Path, host_render: HostRender) -> list[str]:
    """Write one HostRender under `out` (paths below it mirror the host); return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / MANIFEST
    previous: list[str] = []
    if manifest.is_file():
        try:
            previous = list(json.loads(manifest.read_text()).get("files", []))
        except (ValueError, AttributeError):
            previous = []
    for path, item in sorted(host_render.files.items()):
        target = out / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(item.content)
        os.chmod(tmp, item.mode)
        tmp.replace(target)
    for stale in set(previous) - set(host_render.files):
        stale_path = out / stale.lstrip("/")
        if stale_path.is_file():
            stale_path.unlink()
    manifest.write_text(
        json.dumps({"files": sorted(host_render.files), "digest": host_render.digest}) + "\n"
    )
    return sorted(host_render.files)
