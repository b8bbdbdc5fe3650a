"""The one tree digest: names a host's rendered tree and the release made of it.

`hgxserve render` prints it, the release id is built from it, and the host's release store
computes it again over the files it staged (`hgxserve release verify`), so all three agree.

>>> tree_digest({"/a": ("x", 0o644)})[:12]
'1250acf02ca2'
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping

# A topology's `files:` are templates, plugins and configs: small. Anything larger, or anything
# that is not a regular file (/dev/zero, a FIFO that would block `validate` forever), is refused.
MAX_SHIPPED_FILE_BYTES = 64 << 20


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


def shipped_file_sha256(path: str, max_bytes: int = MAX_SHIPPED_FILE_BYTES) -> str:
    """sha256 of a regular file of at most `max_bytes`, for a topology's `files:` sources.

    Raises OSError (with strerror) for a file that is missing, unreadable, not a regular file
    (device, FIFO, directory, socket: opened without blocking and refused) or too large.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(0, "not a regular file (a device, FIFO, directory or socket)", path)
        if info.st_size > max_bytes:
            raise OSError(0, f"{info.st_size} bytes, over the {max_bytes}-byte bound", path)
        h = hashlib.sha256()
        left = max_bytes + 1
        while left > 0 and (block := os.read(fd, min(1 << 20, left))):
            h.update(block)
            left -= len(block)
        if left <= 0:
            raise OSError(0, f"grew past the {max_bytes}-byte bound while read", path)
        return h.hexdigest()
    finally:
        os.close(fd)
