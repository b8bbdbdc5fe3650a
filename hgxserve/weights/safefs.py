"""Write inside a model tree without following symlinks that are already there.

The destination directory itself is what the user named (it may be a link, e.g. /models ->
/nvme/models); below it every directory is opened with O_NOFOLLOW relative to its parent's file
descriptor, and files are created with O_NOFOLLOW, so a link planted in the tree
(`config.json -> /etc/shadow`, `sub -> /`) makes the sync stop with a clear error instead of
writing where the link points.

    fd = open_parent("/models/x", "sub/model.safetensors", create=True)
    os.open("model.safetensors.partial", WRITE_NEW, 0o644, dir_fd=fd)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from collections.abc import Callable
from typing import Any, cast

from hgxserve.weights.errors import LocalIOError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
WRITE_NEW = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
READ_WRITE = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def _link_error(dest: str, rel: str) -> LocalIOError:
    return LocalIOError(
        f"{os.path.join(dest, rel)} is a symbolic link (or not a directory) inside the "
        "destination; hgxserve never writes through links in a model tree: remove it"
    )


def open_parent(dest: str, rel: str, *, create: bool) -> int:
    """A directory fd for the parent of `rel` under `dest`, each level opened with O_NOFOLLOW.

    Raises LocalIOError when a level is a symlink; FileNotFoundError when it is missing and
    `create` is False.
    """
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    walked: list[str] = []
    try:
        for part in rel.split("/")[:-1]:
            walked.append(part)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # made by a worker alongside
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_error(dest, "/".join(walked)) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in(dir_fd: int, name: str, flags: int, dest: str, rel: str) -> int:
    """os.open(name, flags | O_NOFOLLOW) in `dir_fd` (mode 0644 when it creates the file); a
    symlink there is a LocalIOError."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_error(dest, rel) from None
        raise


def libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A Linux libc call by name (errno kept for ctypes.get_errno), or None where there is none.

    libc_function("syncfs", [ctypes.c_int])
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    func.argtypes = argtypes
    func.restype = ctypes.c_int
    return cast("Callable[..., int]", func)


_SYNCFS = libc_function("syncfs", [ctypes.c_int])


def sync_filesystem(fd: int) -> None:
    """Make every file written on the filesystem of `fd` durable, and wait (syncfs(2)).

    One call instead of an fsync per file: the kernel's flusher threads write the pages back on
    whatever CPU is free, where an fsync does that work in the calling thread, and the disk gets
    one cache flush, not one per file. An error written back since `fd` was opened (EIO, ENOSPC)
    is raised as OSError. Without syncfs (not Linux): sync(2).
    """
    if _SYNCFS is None:
        os.sync()
        return
    if _SYNCFS(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
