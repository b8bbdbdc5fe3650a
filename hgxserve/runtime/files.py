"""Controller side of a topology's `files:`: the local copy of each file, checked by sha256.

A local source is read where it is; an https:// source is downloaded once into the controller's
cache (named by its sha256) — hosts never download it. Either way the content must match the
topology's pinned sha256, or nothing is shipped.

    >>> local_copy(TopologyFile("t.jinja", "/srv/t.jinja", "4ba2...")) # doctest: +SKIP
    PosixPath('/srv/t.jinja')
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

from hgxserve.base.compat import file_sha256
from hgxserve.base.digests import MAX_SHIPPED_FILE_BYTES, shipped_file_sha256
from hgxserve.runtime.agent_build import CACHE
from hgxserve.topology.model import TopologyFile

FETCH_TIMEOUT_S = 60
MAX_FILE_BYTES = MAX_SHIPPED_FILE_BYTES  # templates, plugins and configs are small


class FileSourceError(RuntimeError):
    """A topology file that cannot be read or fetched, or whose content is not the pinned one."""


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return file_sha256(fh)


def local_copy(spec: TopologyFile, cache: Path | None = None) -> Path:
    """The controller path of `spec`'s content, verified against its sha256."""
    if not spec.is_url:
        path = Path(spec.source)
        try:
            actual = shipped_file_sha256(spec.source)
        except OSError as exc:
            detail = exc.strerror or str(exc)
            raise FileSourceError(f"files.{spec.name}: cannot read {path}: {detail}") from None
        if actual != spec.sha256:
            raise FileSourceError(
                f"files.{spec.name}: {path} has sha256 {actual}, the topology pins {spec.sha256}"
            )
        return path
    target = (cache or CACHE) / "files" / spec.sha256 / spec.name
    if target.is_file() and _sha256(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(spec.source, timeout=FETCH_TIMEOUT_S) as resp:
            data = resp.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise FileSourceError(f"files.{spec.name}: cannot fetch {spec.source}: {exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise FileSourceError(f"files.{spec.name}: {spec.source} is over {MAX_FILE_BYTES} bytes")
    actual = hashlib.sha256(data).hexdigest()
    if actual != spec.sha256:
        raise FileSourceError(
            f"files.{spec.name}: {spec.source} has sha256 {actual}, the topology pins {spec.sha256}"
        )
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")  # one per writer
    partial.write_bytes(data)
    partial.replace(target)
    return target
