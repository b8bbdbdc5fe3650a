"""The hash lock of `runtime_source=index`: what a host may install from a lab mirror.

With `runtime_source=index` each host runs pip against a mirror the controller may not reach,
so the controller cannot build the wheelhouse's own lock (hgxserve.runtime.wheelhouse.hash_lock).
The lab gives one instead (`--data runtime_index_lock=PATH`): a requirements file in which every
requirement is an exact pin with at least one `--hash=sha256:` (what `pip-compile
--generate-hashes` and `uv pip compile --generate-hashes` write). The host installs it with
`pip install --require-hashes --only-binary=:all: -r LOCK`: a file the mirror (or anyone on the
way to an `http://` mirror) changed is refused by pip, and every transitive dependency is
pinned. Options that change where files come from (`-e`, `-r`, `-c`, `--index-url`,
`--extra-index-url`, `-f`, ...) are refused, and so are URL requirements.

    lock = read_index_lock(Path("lab/vllm-0.15.lock"))
    missing = lock.uncovered(["vllm==0.15.0"])   # [] when the lock pins vllm at 0.15.0
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from hgxserve.base.defaults import INDEX_LOCK_MAX_BYTES
from hgxserve.runtime.spec import parse_pin, version_matches

_HASH = re.compile(r"--hash[= ]sha256:([0-9a-f]{64})(?=\s|$)")
_PINNED = re.compile(
    r"\A([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9._,-]*\])?===?([A-Za-z0-9.+!_-]+)\Z"
)


class IndexLockError(ValueError):
    """A lock that is unreadable, too large, or names something it does not pin by hash."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class IndexLock:
    """A checked lock: its path on the controller, its sha256 and its pins (name -> version)."""

    path: str
    sha256: str
    pins: tuple[tuple[str, str], ...]

    def uncovered(self, requirements: tuple[str, ...] | list[str]) -> list[str]:
        """The exact pins of `requirements` that the lock does not pin at that version.

        >>> IndexLock("x", "0" * 64, (("vllm", "0.26.0+sim"),)).uncovered(["vllm==0.26.0"])
        []
        >>> IndexLock("x", "0" * 64, (("vllm", "0.25.0"),)).uncovered(["vllm==0.26.0"])
        ['vllm==0.26.0 (the lock pins 0.25.0)']
        """
        pins = dict(self.pins)
        missing = []
        for requirement in requirements:
            name, version = parse_pin(requirement)
            found = pins.get(_canonical(name))
            if not version_matches(version, found):
                why = f"the lock pins {found}" if found else "not in the lock"
                missing.append(f"{requirement} ({why})")
        return missing


def _read_bounded(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IndexLockError(f"{path}: not a regular file")
        data = b""
        while len(data) <= INDEX_LOCK_MAX_BYTES and (block := os.read(fd, 1 << 16)):
            data += block
        if len(data) > INDEX_LOCK_MAX_BYTES:
            raise IndexLockError(f"{path}: over {INDEX_LOCK_MAX_BYTES} bytes, not a lock")
        return data
    finally:
        os.close(fd)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each requirement line, continuations joined, comments cut."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0] if not raw.lstrip().startswith("#") else ""
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined = (pending + line).strip()
        pending = ""
        if joined:
            lines.append((start, joined))
    if pending.strip():
        lines.append((start, pending.strip()))
    return lines


def _pin(path: str, number: int, line: str) -> tuple[str, str]:
    hashes = _HASH.findall(line)
    rest = _HASH.sub(" ", line).strip()
    requirement = rest.split(";", 1)[0].strip()  # an environment marker is pip's to apply
    if requirement.startswith("-") or " -" in f" {rest}":
        raise IndexLockError(
            f"{path}:{number}: {rest.split()[0]!r}: a lock names pinned requirements with hashes "
            "only (no options that change where files come from)"
        )
    match = _PINNED.match(requirement)
    if not match:
        raise IndexLockError(
            f"{path}:{number}: {requirement[:80]!r} is not an exact pin (name==version)"
        )
    if not hashes:
        raise IndexLockError(f"{path}:{number}: {requirement} has no --hash=sha256:")
    return _canonical(match.group(1)), match.group(3)


def read_index_lock(path: str | Path) -> IndexLock:
    """Read and check a lab's lock on the controller; IndexLockError says what is wrong."""
    path = str(path)
    try:
        data = _read_bounded(path)
    except OSError as exc:
        raise IndexLockError(f"{path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise IndexLockError(f"{path}: not UTF-8 text") from None
    pins: dict[str, str] = {}
    for number, line in _logical_lines(text):
        name, version = _pin(path, number, line)
        if pins.get(name, version) != version:
            raise IndexLockError(
                f"{path}:{number}: {name} is pinned twice ({pins[name]}, {version})"
            )
        pins[name] = version
    if not pins:
        raise IndexLockError(f"{path}: pins nothing")
    return IndexLock(path, hashlib.sha256(data).hexdigest(), tuple(sorted(pins.items())))
