"""What the agent uses from Python 3.11 and later, for hosts whose python3 is 3.10 (Ubuntu
22.04): the code that runs on hosts keeps to 3.10 (scripts/test.sh checks it with vermin).

`timeout(delay)` is `asyncio.timeout`; on 3.10 it is async-timeout's, raising the builtin
`TimeoutError` as 3.11's does. `TIMEOUT_ERRORS` is what an `except` names to catch a timeout
from asyncio or aiohttp on every version (on 3.10 `asyncio.TimeoutError` is not the builtin).
`file_sha256(fh)` is `hashlib.file_digest(fh, "sha256").hexdigest()`.

    >>> file_sha256(__import__("io").BytesIO(b""))[:12]
    'e3b0c44298fc'
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import BinaryIO

TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)

if sys.version_info >= (3, 11):
    from asyncio import timeout  # novermin
else:
    import async_timeout

    @asynccontextmanager
    async def timeout(delay: float | None) -> AsyncIterator[None]:
        try:
            async with async_timeout.timeout(delay):
                yield
        except asyncio.TimeoutError as exc:
            raise TimeoutError from exc


def file_sha256(fh: BinaryIO) -> str:
    """The sha256 hex digest of an open binary file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    while block := fh.read(1 << 20):
        h.update(block)
    return h.hexdigest()


__all__ = ["TIMEOUT_ERRORS", "file_sha256", "timeout"]
