"""pyinfra operation holding a file's content and mode, compared by digest (hgxserve.facts.files).

Example:
    from hgxserve.operations.files import file_content
    file_content(name="Mount unit", dest="/etc/systemd/system/mnt-m.mount", content=text)
"""

from __future__ import annotations

import hashlib
from io import StringIO

from pyinfra import host
from pyinfra.api import operation
from pyinfra.operations import files

from hgxserve.facts.files import FileDigest


@operation()
def file_content(dest: str, content: str, mode: str = "644"):
    """Hold `content` in `dest` with `mode`; unchanged when both already match.

    + dest: absolute path on the host (any name: compared without printing it)
    + content: the file's text
    + mode: octal mode

    **Example:**

    .. code:: python

        file_content(name="Mount unit", dest="/etc/systemd/system/mnt-m.mount", content=text)
    """
    want = (mode.lstrip("0") or "0", hashlib.sha256(content.encode()).hexdigest())
    have = host.get_fact(FileDigest, path=dest)
    if have and tuple(have) == want:
        host.noop(f"{dest} is up to date")
        return
    yield from files.put._inner(src=StringIO(content), dest=dest, mode=mode, force=True)
