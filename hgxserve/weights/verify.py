"""`hgxserve weights verify`: check a tree against its manifest, in parallel, skipping files
unchanged since their last verification, and keep the "verified" marker honest.

    report = verify("/models/x", VerifyOptions(full=True))
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hgxserve.weights.complete import check_complete
from hgxserve.weights.errors import UsageError, VerifyError
from hgxserve.weights.hashing import sha256_file
from hgxserve.weights.manifest import MANIFEST_NAME, Manifest, ManifestFile
from hgxserve.weights.progress import Progress, human_bytes
from hgxserve.weights.state import (
    FileState,
    State,
    read_marker,
    remove_marker,
    save_manifest_copy,
    state_dir_for,
    write_marker,
)
from hgxserve.weights.transfer import io_error


@dataclass
class VerifyOptions:
    """Tunables of one verify run."""

    manifest: str | None = None
    state_dir: str | None = None
    full: bool = False
    workers: int = 0  # 0: one per CPU
    digest: str | None = None  # required manifest digest, if pinned
    # config, tokenizer and every indexed shard present before the marker (--allow-incomplete)
    require_complete: bool = True
    quiet: bool = False
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)


@dataclass
class VerifyReport:
    """What verify found."""

    dest: str
    files: int = 0
    hashed: int = 0
    skipped: int = 0
    bytes_hashed: int = 0
    seconds: float = 0.0
    manifest_digest: str = ""
    errors: list[str] = field(default_factory=list)
    marker: bool = False

    def summary(self) -> str:
        rate = self.bytes_hashed / self.seconds if self.seconds > 0 else 0.0
        head = (
            f"{self.dest}: {self.files} files, {self.hashed} hashed "
            f"({human_bytes(self.bytes_hashed)} in {self.seconds:.1f}s, {human_bytes(rate)}/s), "
            f"{self.skipped} unchanged since last verification"
        )
        if self.errors:
            return head + "\nFAILED:\n  " + "\n  ".join(self.errors) + "\nmarker: removed"
        return head + f"\nmarker: written ({self.manifest_digest})"

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def find_manifest(dest: str, directory: str, explicit: str | None) -> Manifest:
    """The manifest to verify against: explicit, the state dir's copy, or the tree's published one.

    find_manifest("/models/x", "/models/x/.hgxserve", None)
    """
    if explicit:
        return Manifest.load(explicit)
    for candidate in (os.path.join(directory, "manifest.json"), os.path.join(dest, MANIFEST_NAME)):
        if os.path.isfile(candidate):
            return Manifest.load(candidate)
    raise UsageError(
        f"no manifest for {dest}: pass --manifest FILE, or sync it first "
        f"(looked for {directory}/manifest.json and {dest}/{MANIFEST_NAME})"
    )


def verify(dest: str, opts: VerifyOptions) -> VerifyReport:
    """Verify `dest`; write the marker only when every file matches, else remove it.

    verify("/models/x", VerifyOptions())
    """
    started = time.monotonic()
    directory = state_dir_for(dest, opts.state_dir)
    manifest = find_manifest(dest, directory, opts.manifest)
    report = VerifyReport(dest=dest, files=len(manifest.files), manifest_digest=manifest.digest)
    if opts.digest and opts.digest != manifest.digest:
        raise VerifyError(
            f"manifest digest is {manifest.digest}, but {opts.digest} is required",
            hint="pass the manifest that matches the pinned digest with --manifest",
        )
    state = State.load(directory)
    new_state = State(source=state.source, manifest_digest=None)
    to_hash, unchanged = _to_hash(dest, manifest, state, report, opts.full)
    new_state.files.update(unchanged)
    if to_hash:
        # Content is about to be re-judged: a stale marker must not outlive a failed check.
        _safe_remove_marker(directory, dest)
        _hash_all(dest, to_hash, new_state, report, opts)
    report.errors.sort()
    report.seconds = time.monotonic() - started
    try:
        if report.errors:
            _safe_remove_marker(directory, dest)
            new_state.save(directory)
            return report
        if opts.require_complete:
            check_complete(dest, [f.path for f in manifest.files], directory)
        new_state.manifest_digest = manifest.digest
        save_manifest_copy(directory, manifest)
        if new_state.to_json() != state.to_json():
            new_state.save(directory)
        if read_marker(directory) != manifest.digest:
            write_marker(directory, manifest.digest)
    except OSError as exc:
        raise io_error(exc, directory, dest) from None
    report.marker = True
    return report


def _hash_all(
    dest: str,
    to_hash: list[tuple[ManifestFile, FileState | None]],
    new_state: State,
    report: VerifyReport,
    opts: VerifyOptions,
) -> None:
    """Hash the files in parallel: matches go to the new state, the rest to the report."""
    total = sum(e.size for e, _ in to_hash)
    progress = Progress("verify", total, len(to_hash), quiet=opts.quiet)
    lock = threading.Lock()

    def one(item: tuple) -> None:
        entry, known = item
        path = os.path.join(dest, entry.path)
        try:
            before = os.stat(path)
            sha = sha256_file(path, progress.add)
        except OSError as exc:
            with lock:
                report.errors.append(f"{entry.path}: {exc.strerror}")
            return
        progress.file_done()
        with lock:
            report.hashed += 1
            report.bytes_hashed += entry.size
            if sha != entry.sha256:
                report.errors.append(
                    f"{entry.path}: sha256 {sha} does not match the manifest ({entry.sha256})"
                )
                return
            new_state.files[entry.path] = FileState(
                entry.size,
                before.st_mtime_ns,
                sha,
                known.etag if known else entry.etag,
                known.verified_by if known and known.verified_by != "none" else "manifest",
            )

    workers = opts.workers or os.cpu_count() or 2
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, to_hash))
    finally:
        progress.close()


def _to_hash(
    dest: str, manifest: Manifest, state: State, report: VerifyReport, full: bool
) -> tuple[list[tuple[ManifestFile, FileState | None]], dict[str, FileState]]:
    """(the files whose content must be hashed, the files unchanged since their recorded
    verification); missing and wrong-size files go to the report."""
    to_hash = []
    unchanged_files: dict[str, FileState] = {}
    for entry in manifest.files:
        path = os.path.join(dest, entry.path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            report.errors.append(f"{entry.path}: missing")
            continue
        except OSError as exc:
            report.errors.append(f"{entry.path}: {exc.strerror}")
            continue
        if st.st_size != entry.size:
            word = "truncated" if st.st_size < entry.size else "too long"
            report.errors.append(
                f"{entry.path}: {word}: {st.st_size} bytes, the manifest says {entry.size}"
            )
            continue
        known = state.files.get(entry.path)
        unchanged = known is not None and known.matches_stat(st) and known.sha256 == entry.sha256
        if not full and known is not None and unchanged:
            unchanged_files[entry.path] = known
            report.skipped += 1
            continue
        to_hash.append((entry, known))
    return to_hash, unchanged_files


def _safe_remove_marker(directory: str, dest: str) -> None:
    try:
        remove_marker(directory)
    except OSError as exc:
        raise io_error(exc, directory, dest) from None
