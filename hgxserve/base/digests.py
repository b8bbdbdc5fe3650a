"""The one tree digest: names a host's rendered tree and the release made of it.

`hgxserve render` prints it, the release id is built from it, and the host's release store
computes it again over the files it staged (`hgxserve release verify`), so all three agree.

>>> tree_digest({"/a": ("x", 0o644)})[:12]
'1250acf02ca2'
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


def tree_digest(files: Mapping[str, tuple[str | bytes, int]]) -> str:
    """sha256 over the sorted paths, modes and contents of {path: (content, mode)}.

    The content length is part of the stream, so no two trees share one.
    """
    h = hashlib.sha256()
    for path in sorted(files):
        content, mode = files[path]
        data = content.encode() if isinstance(content, str) else content
        h.update(f"{path}\0{mode:o}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()
