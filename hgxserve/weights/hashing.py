"""File hashing that keeps both cores busy: hashlib releases the GIL on large buffers.

digest = sha256_file("/models/x/model-00001-of-00048.safetensors")
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable

CHUNK = 8 * 1024 * 1024


def sha256_file(path: str, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 hex of a file, read with readinto into one reused buffer.

    sha256_file("/models/x/config.json")
    """
    hasher = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        # The file is read once, front to back: tell the kernel to read ahead aggressively.
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
            if on_bytes:
                on_bytes(n)
    return hasher.hexdigest()
