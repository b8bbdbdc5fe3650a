"""The local state record, the manifest copy and the "verified" marker of a model tree.

Layout (state dir defaults to `DEST/.hgxserve`; a read-only CephFS mount uses a directory under
/var/lib/hgxserve/weights instead):

    .hgxserve/state.json     per file: size, mtime_ns, etag, sha256, verified_by
    .hgxserve/manifest.json  the manifest the tree was synced/verified against
    .hgxserve/verified       the manifest digest, written only when every file matched

    ok, why = check_marker("/models/x", None, "sha256:9f2c...")
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from hgxserve.weights.manifest import Manifest, atomic_write, write_if_changed

STATE_SCHEMA = "hgxserve.weights.state/1"
STATE_DIR_NAME = ".hgxserve"


def state_dir_for(dest: str, state_dir: str | None = None) -> str:
    """Directory holding state.json, manifest.json and the marker for `dest`.

    state_dir_for("/models/x")  # "/models/x/.hgxserve"
    """
    return state_dir or os.path.join(dest, STATE_DIR_NAME)


@dataclass
class FileState:
    """What was true of one file when it was last verified."""

    size: int
    mtime_ns: int
    sha256: str
    etag: str | None = None
    verified_by: str = "manifest"  # manifest | s3-checksum | none (size+ETag only)

    def matches_stat(self, st: os.stat_result) -> bool:
        return st.st_size == self.size and st.st_mtime_ns == self.mtime_ns


@dataclass
class State:
    """The whole state record of a model tree."""

    source: str | None = None
    manifest_digest: str | None = None
    files: dict[str, FileState] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: str) -> State:
        path = os.path.join(directory, "state.json")
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (FileNotFoundError, NotADirectoryError):
            return cls()
        except (OSError, ValueError):
            # A damaged record only costs a rehash; it never makes a file count as verified.
            return cls()
        if not isinstance(data, dict) or data.get("schema") != STATE_SCHEMA:
            return cls()
        files: dict[str, FileState] = {}
        for path_key, entry in (data.get("files") or {}).items():
            try:
                files[path_key] = FileState(
                    size=int(entry["size"]),
                    mtime_ns=int(entry["mtime_ns"]),
                    sha256=str(entry["sha256"]),
                    etag=entry.get("etag"),
                    verified_by=str(entry.get("verified_by", "none")),
                )
            except (KeyError, TypeError, ValueError):
                continue
        return cls(data.get("source"), data.get("manifest_digest"), files)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "source": self.source,
            "manifest_digest": self.manifest_digest,
            "files": {
                path: {
                    "size": f.size,
                    "mtime_ns": f.mtime_ns,
                    "sha256": f.sha256,
                    "etag": f.etag,
                    "verified_by": f.verified_by,
                }
                for path, f in sorted(self.files.items())
            },
        }

    def save(self, directory: str) -> None:
        atomic_write(
            os.path.join(directory, "state.json"),
            json.dumps(self.to_json(), indent=1, sort_keys=True).encode() + b"\n",
        )


def marker_path(directory: str) -> str:
    return os.path.join(directory, "verified")


def read_marker(directory: str) -> str | None:
    """The digest in the marker, or None when there is no marker."""
    try:
        with open(marker_path(directory), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def write_marker(directory: str, digest: str) -> None:
    atomic_write(marker_path(directory), (digest + "\n").encode())


def remove_marker(directory: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker_path(directory))


def save_manifest_copy(directory: str, manifest: Manifest) -> None:
    write_if_changed(os.path.join(directory, "manifest.json"), manifest.dumps())


def check_marker(dest: str, state_dir: str | None, digest: str | None) -> tuple[bool, str]:
    """Cheap pre-start check: marker equals the digest and no file changed since verification.

    Costs one read of the marker and state record and one stat per file; never hashes.

        ok, why = check_marker("/models/x", None, "sha256:9f2c...")
    """
    directory = state_dir_for(dest, state_dir)
    marker = read_marker(directory)
    if marker is None:
        return False, f"{dest}: not verified (no marker in {directory})"
    if digest and marker != digest:
        return False, f"{dest}: verified for {marker}, but {digest} is required"
    state = State.load(directory)
    if state.manifest_digest != marker or not state.files:
        return False, f"{dest}: state record does not belong to marker {marker}"
    for path, entry in state.files.items():
        try:
            st = os.stat(os.path.join(dest, path))
        except OSError:
            return False, f"{dest}/{path}: missing since verification"
        if not entry.matches_stat(st):
            return False, (
                f"{dest}/{path}: changed since verification (size {st.st_size}, was {entry.size})"
            )
    return True, f"{dest}: verified {marker} ({len(state.files)} files)"
