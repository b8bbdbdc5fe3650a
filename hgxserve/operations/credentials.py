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
def secret_file(dest: str, content: str, group: str = "root"):
    """Hold `content` in `dest` (root, 0600) inside a root 0700 directory; with a `group`,
    0640 inside a 0750 directory, both of that group (a service user that reads the secret).

    + dest: absolute path of the secret file on the host
    + content: the secret (never in a command line: it travels as an upload)
    + group: the group that may read it (root: none but root)

    Example:
        secret_file(name="Install credential", dest="/etc/hgxserve/credentials/k", content=k)
    """
    if not dest.startswith("/") or dest.endswith("/"):
        raise OperationError(f"secret file {dest!r}: not an absolute file path")
    directory = posixpath.dirname(dest)
    q = shlex.quote
    dir_mode, mode = (0o700, 0o600) if group == "root" else (0o750, 0o640)
    have_dir = host.get_fact(Directory, path=directory)
    if not have_dir or _mode(have_dir) != dir_mode or have_dir.get("group") != group:
        yield f"install -d -m {dir_mode:o} -o root -g {q(group)} {q(directory)}"
    have = host.get_fact(File, path=dest)
    if not have or _mode(have) != mode or have.get("group") != group:
        # created empty and unreadable (umask 077 covers the instant before chmod) before content
        yield (
            f"(umask 077 && touch {q(dest)}) && chown root:{q(group)} {q(dest)} && "
            f"chmod {mode:o} {q(dest)}"
        )
    yield from files.put._inner(
        src=StringIO(content), dest=dest, user="root", group=group, mode=f"{mode:o}",
        assume_exists=False,
    )  # fmt: skip
