"""pyinfra facts about files: a file's mode and content digest, the files below a directory.

Example:
    >>> host.get_fact(FilesUnder, path="/etc/prometheus/hgxserve")  # doctest: +SKIP
    ['/etc/prometheus/hgxserve/targets.json']
"""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase


class FileDigest(FactBase):
    """A file's mode and the sha256 of its content, or None when it is not a file.

    pyinfra's own file hash facts parse `sha1sum PATH`, which GNU coreutils prints as
    `\\<hash>  <escaped path>` when the path holds a backslash, as every escaped mount unit
    name does (`mnt-hgxserve\\x2dmodels.mount`): the fact then reads "no such file" and
    `files.put` uploads on every run. Hashing stdin names no path.

    Example:
        >>> FileDigest().process(["644", "ab" * 32 + "  -"])
        ('644', 'abababababababababababababababababababababababababababababababab')
    """

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        return f"if [ -f {p} ]; then stat -c %a {p} && sha256sum < {p}; fi"

    def process(self, output: list[str]) -> tuple[str, str] | None:
        if len(output) < 2 or not output[1].split():
            return None
        return output[0].strip(), output[1].split()[0]


class FilesUnder(FactBase):
    """Files below a directory (none when it does not exist)."""

    default = list

    def command(self, path: str) -> str:
        return f"find {shlex.quote(path)} -type f 2>/dev/null || true"

    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line]
