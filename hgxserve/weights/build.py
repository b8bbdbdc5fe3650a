"""`hgxserve weights manifest`: build (and publish) the manifest of a model tree.

For S3, an object's own full-object SHA256 checksum is used where the store keeps one; every other
object is read once and hashed (files in parallel, parts in order). For a directory, every file is
hashed in parallel.

    manifest, notes = build_manifest("s3://models/x/", S3Options(), concurrency=16)
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

from hgxserve.weights.manifest import MANIFEST_NAME, Manifest, ManifestFile
from hgxserve.weights.s3 import S3Options
from hgxserve.weights.sources import LocalSource, S3Source, open_source
from hgxserve.weights.transfer import SourceFile

STREAM_PART = 16 << 20


def build_manifest(
    src: str, s3_options: S3Options, concurrency: int = 16, trust_checksums: bool = True
) -> tuple[Manifest, dict[str, int], S3Source | LocalSource]:
    """Manifest of `src` and counts of how each sha256 was obtained.

    build_manifest("/mnt/models/x", S3Options())
    """
    source = open_source(src, s3_options)
    listing = source.list()
    how: dict[str, int] = {}

    def one(path: str) -> ManifestFile:
        listed = listing[path]
        etag: str | None = listed.etag
        version: str | None = None
        if isinstance(source, S3Source):
            if trust_checksums and listed.has_sha256_checksum:
                sha, version, _ = source.sha256_checksum(path)
                if sha:
                    how["s3-checksum"] = how.get("s3-checksum", 0) + 1
                    return ManifestFile(path, listed.size, sha, etag, version)
            sha = _stream_sha256(source, SourceFile(path, listed.size, listed.etag))
        else:
            etag = None  # a directory has no ETag; size:mtime is not worth publishing
            from hgxserve.weights.hashing import sha256_file

            sha = sha256_file(os.path.join(source.root, path))
        how["read"] = how.get("read", 0) + 1
        return ManifestFile(path, listed.size, sha, etag, version)

    workers = concurrency if isinstance(source, S3Source) else (os.cpu_count() or 2)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        files = list(pool.map(one, sorted(listing)))
    if isinstance(source, LocalSource):
        source.close()
    return Manifest(files=files, source=src), how, source


def _stream_sha256(source: S3Source, f: SourceFile) -> str:
    hasher = hashlib.sha256()
    buf = bytearray(min(STREAM_PART, max(f.size, 1)))
    offset = 0
    while offset < f.size:
        length = min(len(buf), f.size - offset)
        view = memoryview(buf)[:length]
        source.fetch_into(f, offset, view)
        hasher.update(view)
        offset += length
    return hasher.hexdigest()


def publish(source: S3Source | LocalSource, manifest: Manifest) -> str:
    """Write the manifest next to the model as hgxserve-manifest.json; returns where."""
    return source.publish(MANIFEST_NAME, manifest.dumps())
