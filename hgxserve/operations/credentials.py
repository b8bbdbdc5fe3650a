"""Secret files pushed to hosts: 0600 inside a 0700 directory before any content arrives.

`files.put(mode="600")` uploads first and chmods after, so for a moment the secret has the
umask's mode. Here the directory is made 0700 and the file created empty at 0600 first; only then
is the content uploaded into it (and the mode enforced once more).

    from hgxserve.operations.credentials import secret_file
    secret_file(name="Install credential", dest="/etc/hgxserve/credentials/api-key", content=k)
"""

from __future__ import annotations

import posixpath
import shlex
from io import StringIO

from pyinfra import host
from pyinfra.api import OperationError, operation
from pyinfra.facts.files import Directory, File
from pyinfra.operations import files


def _mode(info: object) -> int | None:
    if not isinstance(info, dict) or info.get("mode") is None:
        return None
    return int(str(info["mode"]), 8)


@operation()
def secret_file(dest: str, content: str):
    """Hold `content` in `dest` (root, 0600) inside a root 0700 directory.

    + dest: absolute path of the secret file on the host
    + content: the secret (never in a command line: it travels as an upload)

    Example:
        secret_file(name="Install credential", dest="/etc/hgxserve/credentials/k", content=k)
    """
    if not dest.startswith("/") or dest.endswith("/"):
        raise OperationError(f"secret file {dest!r}: not an absolute file path")
    directory = posixpath.dirname(dest)
    q = shlex.quote
    have_dir = host.get_fact(Directory, path=directory)
    if not have_dir or _mode(have_dir) != 0o700:
        yield f"install -d -m 700 -o root -g root {q(directory)}"
    have = host.get_fact(File, path=dest)
    if not have or _mode(have) != 0o600:
        # created empty at 0600 (umask 077 covers the instant before chmod) before content
        yield f"(umask 077 && touch {q(dest)}) && chown root:root {q(dest)} && chmod 600 {q(dest)}"
    yield from files.put._inner(
        src=StringIO(content), dest=dest, user="root", group="root", mode="600", assume_exists=False
    )
