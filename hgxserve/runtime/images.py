"""Container images for engines, pinned by digest: fetch an image archive from S3 and prove,
before `podman load`, that it holds exactly the pinned manifest.

An OCI image archive (`podman save --format oci-archive`, `skopeo copy docker://repo@sha256:X
oci-archive:x.tar`) keeps the manifest digest: `index.json` names it, and the manifest blob
under `blobs/sha256/` must hash to it. `verify_archive` checks both, plus the config and layer
blobs the manifest lists (their sizes and sha256), streaming the tar once. A docker-archive
(`docker save`) has no manifest digest and is refused.

    >>> verify_archive("/var/lib/hgxserve/images/abc.tar", "sha256:abc...")  # doctest: +SKIP
    'sha256:abc...'
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hgxserve.base.errors import Found

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
CHUNK = 8 << 20


class ImageArchiveError(Found, ValueError):
    """An archive that is not the pinned image (or not an OCI archive at all): exit 1."""


def image_digest(image: str) -> str:
    """The `sha256:...` part of `repo@sha256:...`.

    >>> image_digest("docker.io/lmsysorg/sglang@sha256:" + "a" * 64)[:12]
    'sha256:aaaaa'
    """
    _, _, digest = image.rpartition("@")
    if not DIGEST.match(digest):
        raise ImageArchiveError(f"{image}: not pinned by digest (repo@sha256:<64 hex>)")
    return digest


def archive_name(digest: str) -> str:
    """The archive's object name under the S3 prefix: named by the digest it must hold."""
    return digest.replace(":", "-") + ".oci.tar"


def _blob_name(digest: str) -> str:
    return "blobs/" + digest.replace(":", "/", 1)


def verify_archive(path: str | os.PathLike[str], digest: str) -> str:
    """Check that the OCI archive at `path` holds the image manifest `digest`; return it."""
    if not DIGEST.match(digest):
        raise ImageArchiveError(f"{digest}: not a sha256 digest")
    index, hashes = _scan_archive(path)
    listed = [m.get("digest") for m in index.get("manifests", []) if isinstance(m, dict)]
    if digest not in listed:
        raise ImageArchiveError(
            f"{path}: holds manifest(s) {', '.join(map(str, listed)) or 'none'}, not {digest}"
        )
    blob = _blob_name(digest)
    if blob not in hashes or "sha256:" + hashes[blob][0] != digest:
        raise ImageArchiveError(f"{path}: the manifest blob {blob} is missing or altered")
    with tarfile.open(path, mode="r|*") as tar:
        manifest = _read_member(tar, blob)
    for part in [manifest.get("config", {}), *manifest.get("layers", [])]:
        want, size = part.get("digest", ""), part.get("size")
        got = hashes.get(_blob_name(want)) if DIGEST.match(str(want)) else None
        if got is None or "sha256:" + got[0] != want or (size is not None and got[1] != size):
            raise ImageArchiveError(f"{path}: blob {want} is missing or altered")
    return digest


def _scan_archive(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    """The archive's index.json and every blob's (sha256 hex, size), in one pass over the tar."""
    hashes: dict[str, tuple[str, int]] = {}
    index: dict[str, Any] | None = None
    try:
        with tarfile.open(path, mode="r|*") as tar:
            seen: set[str] = set()
            for member in tar:
                name = _member_name(path, member, seen)
                fh = tar.extractfile(member) if member.isfile() else None
                if fh is None:
                    continue
                if name == "index.json":
                    index = json.loads(fh.read(1 << 20))
                elif name.startswith("blobs/sha256/"):
                    hashes[name] = _hash_stream(fh)
    except (OSError, tarfile.TarError, ValueError) as exc:
        raise ImageArchiveError(f"{path}: not a readable image archive: {exc}") from None
    if index is None:
        raise ImageArchiveError(
            f"{path}: no index.json: not an OCI archive (save it with "
            "`podman save --format oci-archive` or `skopeo copy ... oci-archive:`)"
        )
    return index, hashes


def _member_name(path: str | os.PathLike[str], member: tarfile.TarInfo, seen: set[str]) -> str:
    """The member's name as an extractor reads it, refusing what could make the extracted
    image differ from the checked one: a name that is not canonical (`blobs//sha256/x`,
    `././blobs/…`, `..`, absolute: an extractor normalises them onto a checked name), a second
    member of the same name (the later one wins on extraction), and a link or device where
    index.json or a blob belongs."""
    raw = member.name
    name = raw[2:] if raw.startswith("./") else raw
    if name.startswith("/") or name != posixpath.normpath(name) or name.split("/")[0] == "..":
        raise ImageArchiveError(
            f"{path}: member {raw!r} has a non-canonical name (an extractor reads it as "
            f"{posixpath.normpath(name)!r}): refused"
        )
    if name in seen and name != ".":
        raise ImageArchiveError(f"{path}: member {name!r} appears twice: refused")
    seen.add(name)
    if (name == "index.json" or name.startswith("blobs/")) and not (
        member.isfile() or member.isdir()
    ):
        raise ImageArchiveError(f"{path}: member {name!r} is a link or device: refused")
    return name


def _hash_stream(fh: IO[bytes]) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    while chunk := fh.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def _read_member(tar: tarfile.TarFile, name: str) -> dict[str, Any]:
    for member in tar:
        if member.name.removeprefix("./") == name:
            fh = tar.extractfile(member)
            if fh is not None:
                return dict(json.loads(fh.read(16 << 20)))
    raise ImageArchiveError(f"{name}: missing")


def fetch_archive(
    url: str, dest: Path, *, endpoint_url: str | None, region: str | None, addressing: str
) -> int:
    """Download `s3://bucket/key` to `dest` (through a .part file); return the byte count."""
    from hgxserve.weights.s3 import S3Options, S3Url, make_client

    where = S3Url.parse(url)
    client = make_client(
        where.bucket, S3Options(endpoint_url=endpoint_url, region=region, addressing=addressing)
    )
    key = where.prefix
    try:
        size = next(o.size for o in client.list_objects(key) if o.key == key)
    except StopIteration:
        raise ImageArchiveError(f"{url}: no such object") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    buf = bytearray(min(CHUNK * 4, max(size, 1)))
    with partial.open("wb") as out:
        offset = 0
        while offset < size:
            view = memoryview(buf)[: min(len(buf), size - offset)]
            client.get_range_into(key, offset, view, None)
            out.write(view)
            offset += len(view)
    partial.replace(dest)
    client.close()
    return size


@dataclass(frozen=True)
class S3Fetch:
    """Where `fetch-image` and `fetch-wheel` fetch from: the weights' S3 settings."""

    env_file: str | None = None  # KEY=VALUE file with the S3 credentials (0600)
    endpoint_url: str | None = None
    region: str | None = None
    addressing: str = "auto"

    def fetch(self, url: str, dest: Path) -> int:
        """`fetch_archive` with these settings (the credentials applied first)."""
        from hgxserve.weights.credentials import apply_env_file

        apply_env_file(self.env_file)
        return fetch_archive(
            url,
            dest,
            endpoint_url=self.endpoint_url,
            region=self.region,
            addressing=self.addressing,
        )


def fetch_image(url: str, digest: str, dest: Path, s3: S3Fetch) -> int | None:
    """Fetch the OCI archive at `url` to `dest` and verify it holds image manifest `digest`:
    the byte count, or None when `dest` already held it. Nothing is left at `dest` unless it
    holds the pinned image (ImageArchiveError otherwise)."""
    if dest.is_file():
        try:
            verify_archive(dest, digest)
            return None
        except ImageArchiveError:
            dest.unlink()
    size = s3.fetch(url, dest)
    try:
        verify_archive(dest, digest)
    except ImageArchiveError:
        dest.unlink(missing_ok=True)
        raise
    return size


def fetch_file(url: str, sha256: str, dest: Path, s3: S3Fetch) -> str | None:
    """Fetch the file at `url` to `dest` unless it already has `sha256`: None when it had, else
    the sha256 the fetched file has; nothing is left at `dest` unless it is `sha256`."""
    from hgxserve.base.compat import file_sha256

    if dest.is_file():
        with open(dest, "rb") as fh:
            if file_sha256(fh) == sha256:
                return None
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    s3.fetch(url, dest)
    with open(dest, "rb") as fh:
        got = file_sha256(fh)
    if got != sha256:
        dest.unlink(missing_ok=True)
    return got
