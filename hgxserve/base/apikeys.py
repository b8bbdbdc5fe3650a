"""API keys read from files: the one check of a key file and of a key, wherever hgxserve reads
or pushes one (the proxy at start, the release gate, `hgxserve bench --api-key-file`, the keys
the controller pushes from its environment).

A key file must be a regular file with no group or other permission bits (0600 or stricter),
and the key at least MIN_API_KEY_LENGTH characters of printable ASCII, of at least
MIN_API_KEY_DISTINCT distinct characters and no shorter pattern repeated (hgxserve.base.defaults
says why). Messages name the file and what is wrong, never the key.

    key = read_key_file("/run/credentials/hgxserve-proxy.service/api-key", "API key")
"""

from __future__ import annotations

import os
import stat

from hgxserve.base.defaults import API_KEY_MAX_BYTES, MIN_API_KEY_DISTINCT, MIN_API_KEY_LENGTH

_GENERATE = "generate one: openssl rand -hex 32"


class KeyFileError(ValueError):
    """A key file that is not a private regular file, or a key too short to be one."""


def key_problem(key: str) -> str | None:
    """Why `key` is not an acceptable API key (None when it is); the key itself is not said.

    >>> key_problem("k" * 32)[:30]
    'only 1 distinct characters, fe'
    >>> key_problem("0123456789abcdef" + chr(10) + "0123456789abcdef")[:30]
    'a character inside it that is '
    >>> key_problem("0123456789abcdef0123456789abcdef")[:26]
    'a shorter pattern repeated'
    >>> key_problem("hgxserve-demo-api-key-0123456789") is None
    True
    """
    if not key:
        return "empty"
    if len(key) < MIN_API_KEY_LENGTH:
        return (
            f"{len(key)} characters, shorter than the {MIN_API_KEY_LENGTH} required ({_GENERATE})"
        )
    if any(not "!" <= c <= "~" for c in key):
        return (
            "a character inside it that is not printable ASCII (a line break, a space, a "
            "control or non-ASCII character): a key is one word of a request header"
        )
    distinct = len(set(key))
    if distinct < MIN_API_KEY_DISTINCT:
        return (
            f"only {distinct} distinct characters, fewer than the {MIN_API_KEY_DISTINCT} a "
            f"generated key has ({_GENERATE})"
        )
    if (key + key).find(key, 1) < len(key):
        return f"a shorter pattern repeated ({_GENERATE})"
    return None


def mode_problem(mode: int) -> str | None:
    """Why a file of `st_mode` `mode` may not hold a key (None when it may)."""
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if mode & 0o077:
        return f"mode {stat.S_IMODE(mode):04o} lets group or others at it (chmod 600)"
    return None


def read_key_file(path: str, what: str = "API key") -> str:
    """The key in `path` (surrounding whitespace dropped), checked; KeyFileError otherwise."""
    try:
        # O_NONBLOCK: a FIFO in place of the file must not hang the reader
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the {what} file: {exc.strerror}") from None
    try:
        problem = mode_problem(os.fstat(fd).st_mode)
        if problem:
            raise KeyFileError(f"{path}: the {what} file: {problem}")
        data = b""
        while len(data) <= API_KEY_MAX_BYTES:
            chunk = os.read(fd, API_KEY_MAX_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > API_KEY_MAX_BYTES:
        raise KeyFileError(f"{path}: the {what} file is larger than {API_KEY_MAX_BYTES} bytes")
    key = data.decode("utf-8", errors="replace").strip()
    problem = key_problem(key)
    if problem:
        raise KeyFileError(f"{path}: the {what} in it: {problem}")
    return key
