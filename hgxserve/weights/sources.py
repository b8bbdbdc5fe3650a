"""Sources a model tree is read from: an S3 prefix or a local/CephFS directory.

source = open_source("s3://models/DeepSeek-V4-Flash/", S3Options(addressing="virtual"))
listing = source.list()
"""

from __future__ import annotations

import base64
import binascii
import os
import threading
from dataclasses import dataclass

from hgxserve.weights.errors import SourceError
from hgxserve.weights.manifest import MANIFEST_NAME, check_relative_path
from hgxserve.weights.s3 import S3Client, S3Options, S3Url, make_client
from hgxserve.weights.state import STATE_DIR_NAME
from hgxserve.weights.transfer import PARTIAL_SUFFIX, PARTS_SUFFIX, OnData, SourceFile

# A consumer that writes parts out gets them in slices of this size (see Source.fetch_into).
READ_SLICE = 1 << 20


@dataclass
class Listed:
    """One file as the source lists it."""

    path: str
    size: int
    etag: str
    has_sha256_checksum: bool = False


def _skip_name(path: str) -> bool:
    base = os.path.basename(path)
    return (
        path == MANIFEST_NAME
        or path.startswith(STATE_DIR_NAME + "/")
        or base.endswith(PARTIAL_SUFFIX)
        or base.endswith(PARTS_SUFFIX)
    )


class S3Source:
    """Objects under an S3 prefix; parts come from ranged GETs pinned to the listed ETag."""

    kind = "s3"

    def __init__(self, url: S3Url, client: S3Client) -> None:
        prefix = url.prefix
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.url = S3Url(url.bucket, prefix)
        self.client = client
        self.has_published_manifest = False

    def __str__(self) -> str:
        return str(self.url)

    def key(self, path: str) -> str:
        return self.url.prefix + path

    def describe(self, f: SourceFile) -> str:
        return f"s3://{self.url.bucket}/{self.key(f.path)}"

    def list(self) -> dict[str, Listed]:
        out: dict[str, Listed] = {}
        for obj in self.client.list_objects(self.url.prefix):
            if obj.key.endswith("/"):
                continue  # "directory" placeholder objects
            path = obj.key[len(self.url.prefix) :]
            if path == MANIFEST_NAME:
                self.has_published_manifest = True
            if _skip_name(path):
                continue
            check_relative_path(path)
            algorithms = (obj.checksum_algorithm or "").upper().split(",")
            out[path] = Listed(path, obj.size, obj.etag, "SHA256" in algorithms)
        return out

    def read_small(self, path: str) -> bytes:
        return self.client.get_bytes(self.key(path))

    def sha256_checksum(self, path: str) -> tuple[str | None, str | None, str]:
        """(sha256 hex or None, version id, note) from the object's own S3 checksum."""
        head = self.client.head_checksum(self.key(path))
        value = head.sha256_b64
        if not value:
            return None, head.version_id, "no sha256 checksum stored"
        if "-" in value or (head.checksum_type or "").upper() == "COMPOSITE":
            return None, head.version_id, "composite (multipart) checksum: not a whole-file sha256"
        try:
            return base64.b64decode(value, validate=True).hex(), head.version_id, "sha256 checksum"
        except (binascii.Error, ValueError):
            return None, head.version_id, "malformed checksum header"

    def fetch_into(
        self, f: SourceFile, offset: int, buf: memoryview, on_data: OnData | None = None
    ) -> None:
        self.client.get_range_into(self.key(f.path), offset, buf, f.etag or None, on_data)

    def publish(self, name: str, body: bytes) -> str:
        self.client.put_bytes(self.key(name), body)
        return f"s3://{self.url.bucket}/{self.key(name)}"


class LocalSource:
    """A directory (local disk or a read-only CephFS mount); parts come from pread."""

    kind = "local"

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise SourceError(f"source directory {root} does not exist or is not a directory")
        self.root = os.path.abspath(root)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.has_published_manifest = os.path.isfile(os.path.join(self.root, MANIFEST_NAME))

    def __str__(self) -> str:
        return self.root

    def describe(self, f: SourceFile) -> str:
        return os.path.join(self.root, f.path)

    def list(self) -> dict[str, Listed]:
        out: dict[str, Listed] = {}
        try:
            for dirpath, dirnames, filenames in os.walk(self.root, onerror=_raise):
                dirnames[:] = sorted(d for d in dirnames if d != STATE_DIR_NAME)
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    path = os.path.relpath(full, self.root).replace(os.sep, "/")
                    if _skip_name(path) or not os.path.isfile(full):
                        continue
                    st = os.stat(full)
                    out[path] = Listed(path, st.st_size, f"{st.st_size}:{st.st_mtime_ns}")
        except OSError as exc:
            raise SourceError(f"cannot read source directory {self.root}: {exc}") from None
        return out

    def read_small(self, path: str) -> bytes:
        with open(os.path.join(self.root, path), "rb") as fh:
            return fh.read()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(os.path.join(self.root, path), os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def fetch_into(
        self, f: SourceFile, offset: int, buf: memoryview, on_data: OnData | None = None
    ) -> None:
        try:
            fd = self._fd(f.path)
        except OSError as exc:
            raise SourceError(f"{self.describe(f)}: {exc.strerror or exc}") from None
        # Without a consumer one large read; with one, slices it writes while they are cached.
        step = READ_SLICE if on_data is not None else len(buf)
        got = 0
        while got < len(buf):
            try:
                n = os.preadv(fd, [buf[got : got + step]], offset + got)
            except OSError as exc:
                raise SourceError(f"{self.describe(f)}: {exc.strerror or exc}") from None
            if n == 0:
                raise SourceError(f"{self.describe(f)}: file ended early (changed while read?)")
            if on_data is not None:
                on_data(got, got + n)
            got += n

    def publish(self, name: str, body: bytes) -> str:
        from hgxserve.weights.manifest import atomic_write

        path = os.path.join(self.root, name)
        atomic_write(path, body)
        return path

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _raise(exc: OSError) -> None:
    raise exc


def is_s3(src: str) -> bool:
    return src.startswith("s3://")


def open_source(src: str, s3_options: S3Options, on_retry: object = None) -> S3Source | LocalSource:
    """An S3Source for s3:// URLs, a LocalSource for directories.

    open_source("/mnt/cephfs/models/x", S3Options())
    """
    if is_s3(src):
        url = S3Url.parse(src)
        client = make_client(url.bucket, s3_options, on_retry=on_retry)  # type: ignore[arg-type]
        return S3Source(url, client)
    return LocalSource(src)
