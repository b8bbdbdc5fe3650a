"""File hashing that keeps both cores busy: hashlib releases the GIL on large buffers.

digest = sha256_file("/models/x/model-00001-of-00048.safetensors")
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Callable

CHUNK = 8 * 1024 * 1024
# Slice of a mapped file handed to hashlib at a time (it releases the GIL on each).
MAPPED_SLICE = 4 << 20


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


def sha256_mapped(fd: int) -> str:
    """sha256 hex of an open regular file, hashed straight from its page-cache pages (mmap).

    For a file that was just written (it is in the page cache): a read() would first copy every
    byte into a buffer, which on the benchmark VM costs as much CPU as hashing it (1 GiB: read +
    hash 1.3 CPU-s, mapped 0.7 CPU-s, docs/weights.md). Only for files nobody else writes
    while they are hashed (a file cut short under a mapping raises SIGBUS).

    with open(path, "rb") as fh: digest = sha256_mapped(fh.fileno())
    """
    hasher = hashlib.sha256()
    size = os.fstat(fd).st_size
    if size == 0:
        return hasher.hexdigest()
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
        with contextlib.suppress(AttributeError, OSError):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mapped) as view:
            for offset in range(0, size, MAPPED_SLICE):
                hasher.update(view[offset : offset + MAPPED_SLICE])
    return hasher.hexdigest()
