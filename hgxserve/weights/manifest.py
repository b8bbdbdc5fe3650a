"""The weights manifest: every file's path, size and sha256, and one digest for the whole model.

The digest is the sha256 of the canonical JSON of `{"schema", "files": [{"path","size","sha256"}]}`
(sorted keys, no spaces, UTF-8, files sorted by path). Source ETags and version ids are recorded
for diagnosis but stay out of the digest, so one model has one digest whether it sits in S3, on
CephFS or on local NVMe.

    manifest = Manifest.load("/models/DeepSeek-V4-Flash/hgxserve-manifest.json")
    print(manifest.digest)  # sha256:9f2c...
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from hgxserve.weights.errors import UsageError, VerifyError

SCHEMA = "hgxserve.weights.manifest/1"
MANIFEST_NAME = "hgxserve-manifest.json"


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8.

    canonical_json({"b": 1, "a": [2]})  # b'{"a":[2],"b":1}'
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class ManifestFile:
    """One file of the model tree."""

    path: str
    size: int
    sha256: str
    etag: str | None = None
    version_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.etag:
            out["etag"] = self.etag
        if self.version_id:
            out["version_id"] = self.version_id
        return out


@dataclass
class Manifest:
    """A model tree's manifest; `digest` identifies its content."""

    files: list[ManifestFile]
    source: str | None = None
    created_by: str = "hgxserve"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.files.sort(key=lambda f: f.path)
        seen: set[str] = set()
        for f in self.files:
            check_relative_path(f.path)
            if f.path in seen:
                raise VerifyError(f"manifest lists {f.path} twice")
            seen.add(f.path)
            check_size(f.size, f"manifest entry {f.path}")
            if len(f.sha256) != 64 or any(c not in "0123456789abcdef" for c in f.sha256):
                raise VerifyError(
                    f"manifest entry {f.path}: sha256 must be 64 lowercase hex digits"
                )

    @property
    def digest(self) -> str:
        body = {
            "schema": SCHEMA,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, ManifestFile]:
        return {f.path: f for f in self.files}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "digest": self.digest,
            "files": [f.to_json() for f in self.files],
        }
        if self.source:
            out["source"] = self.source
        out["created_by"] = self.created_by
        out.update(self.extra)
        return out

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: Any, origin: str) -> Manifest:
        """Build from parsed JSON; a stated digest that does not match the files is an error."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise VerifyError(f"{origin}: not an hgxserve manifest (schema must be {SCHEMA!r})")
        try:
            files = [
                ManifestFile(
                    path=str(f["path"]),
                    size=int(f["size"]),
                    sha256=str(f["sha256"]),
                    etag=f.get("etag"),
                    version_id=f.get("version_id"),
                )
                for f in data["files"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise VerifyError(f"{origin}: malformed manifest entry ({exc})") from None
        manifest = cls(files=files, source=data.get("source"))
        stated = data.get("digest")
        if stated and stated != manifest.digest:
            raise VerifyError(
                f"{origin}: stated digest {stated} does not match its files ({manifest.digest})"
            )
        return manifest

    @classmethod
    def loads(cls, raw: bytes, origin: str) -> Manifest:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise VerifyError(f"{origin}: not valid JSON ({exc})") from None
        return cls.from_json(data, origin)

    @classmethod
    def load(cls, path: str) -> Manifest:
        try:
            with open(path, "rb") as fh:
                return cls.loads(fh.read(), path)
        except FileNotFoundError:
            raise UsageError(f"manifest {path} does not exist") from None

    def write(self, path: str) -> None:
        atomic_write(path, self.dumps())


# S3's own limit on one object; a listed or manifest size outside [0, this] is a hostile or
# broken source, refused before anything is reserved or fetched
MAX_OBJECT_BYTES = 5 << 40


def check_size(size: object, what: str) -> int:
    """A file size from a listing or a manifest: an int in [0, 5 TiB].

    check_size(1234, "config.json")
    """
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_OBJECT_BYTES:
        raise VerifyError(f"{what}: size {size!r} is outside 0..{MAX_OBJECT_BYTES} bytes")
    return size


def check_relative_path(path: str) -> None:
    """Refuse paths that would escape the destination directory or hold control characters.

    check_relative_path("model-00001-of-00048.safetensors")
    """
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise VerifyError(f"unsafe path in model tree: {path!r}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F or c == "\\" for c in path):
        raise VerifyError(f"unsafe path in model tree: {path!r} (control character or backslash)")


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write a small file so readers see the old or the new content, never half of it.

    atomic_write("/models/x/.hgxserve/state.json", b"{}")
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_if_changed(path: str, data: bytes) -> None:
    """atomic_write, skipped when the file already holds `data` (a no-op sync writes nothing)."""
    try:
        with open(path, "rb") as fh:
            if fh.read() == data:
                return
    except FileNotFoundError:
        pass
    atomic_write(path, data)
