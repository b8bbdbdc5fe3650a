"""`hgxserve weights sync`: bring a model tree to DEST, verified, resumable, cheap when unchanged.

Steps: list the source (and read its published manifest), compare each file with the local state
record (size, mtime_ns, ETag, verified sha256) so unchanged files cost one stat, rehash files that
exist without a record, fetch the rest with the parallel engine (sha256 inline), and write the
"verified" marker only when every file matched.

    report = sync("s3://models/x/", "/models/x", SyncOptions(concurrency=16))
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hgxserve.base.defaults import NATIVE_MIN_SIZE_BYTES, S3_CONCURRENCY, S3_PART_SIZE_BYTES
from hgxserve.weights import native
from hgxserve.weights.complete import check_complete
from hgxserve.weights.errors import SourceError, UsageError, VerifyError, WeightsError
from hgxserve.weights.hashing import sha256_file
from hgxserve.weights.manifest import MANIFEST_NAME, Manifest, ManifestFile, write_if_changed
from hgxserve.weights.progress import Progress, human_bytes
from hgxserve.weights.s3 import S3Options, S3Url, make_client
from hgxserve.weights.sources import Listed, LocalSource, S3Source, is_s3, open_source
from hgxserve.weights.state import (
    FileState,
    State,
    read_marker,
    remove_marker,
    save_manifest_copy,
    state_dir_for,
    write_marker,
)
from hgxserve.weights.transfer import (
    PARTS_SUFFIX,
    FileResult,
    SourceFile,
    Transfer,
    TransferOptions,
    io_error,
)

DEFAULT_CONCURRENCY = S3_CONCURRENCY
DEFAULT_PART_SIZE = S3_PART_SIZE_BYTES


@dataclass
class SyncOptions:
    """Tunables of one sync run."""

    concurrency: int = DEFAULT_CONCURRENCY
    part_size: int = DEFAULT_PART_SIZE
    manifest: str | None = None  # file path, s3:// URL, or "none" to ignore a published one
    state_dir: str | None = None
    s3: S3Options = field(default_factory=S3Options)
    fsync: bool = True
    # sha256 required unless explicitly opted out (--allow-size-etag / model.integrity)
    require_sha256: bool = True
    # config, tokenizer and every indexed shard present before the marker (--allow-incomplete)
    require_complete: bool = True
    quiet: bool = False
    # auto: s5cmd for large files it can fetch, the in-process engine for the rest; python: never
    # s5cmd; s5cmd: refuse to run when it cannot be used
    engine: str = "auto"
    native_min_size: int = NATIVE_MIN_SIZE_BYTES
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)


@dataclass
class SyncReport:
    """What a sync did; printed as a summary and as JSON with --json."""

    source: str
    dest: str
    files: int = 0
    unchanged: int = 0
    rehashed: int = 0
    fetched: int = 0
    bytes_fetched: int = 0
    bytes_resumed: int = 0
    seconds: float = 0.0
    verified_by: dict[str, int] = field(default_factory=dict)
    manifest_digest: str | None = None
    manifest_origin: str = ""
    marker: bool = False
    errors: list[str] = field(default_factory=list)
    source_requests: int = 0
    engine: str = ""

    def summary(self) -> str:
        rate = self.bytes_fetched / self.seconds if self.seconds > 0 else 0.0
        kinds = ", ".join(
            f"{n} by {_KIND_WORDS.get(k, k)}" for k, n in sorted(self.verified_by.items())
        )
        lines = [
            f"{self.dest}: {self.files} files; {self.fetched} fetched "
            f"({human_bytes(self.bytes_fetched)} in {self.seconds:.1f}s, {human_bytes(rate)}/s"
            + (f", {human_bytes(self.bytes_resumed)} resumed" if self.bytes_resumed else "")
            + f"), {self.unchanged} unchanged, {self.rehashed} rehashed",
            f"verified: {kinds or 'nothing'}; "
            f"manifest {self.manifest_digest} ({self.manifest_origin})",
        ]
        if self.engine:
            lines.append(f"engine: {self.engine}")
        lines.append(
            f"marker: written ({self.manifest_digest})" if self.marker else "marker: NOT written"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


_KIND_WORDS = {
    "manifest": "sha256 against the manifest",
    "s3-checksum": "sha256 against the S3 object checksum",
    "none": "size + ETag only (the source offers no sha256)",
}


def load_manifest_ref(ref: str, s3_options: S3Options) -> Manifest:
    """Load a manifest from a file path or an s3:// URL.

    load_manifest_ref("s3://models/x/hgxserve-manifest.json", S3Options())
    """
    if is_s3(ref):
        url = S3Url.parse(ref)
        client = make_client(url.bucket, s3_options)
        return Manifest.loads(client.get_bytes(url.prefix), ref)
    return Manifest.load(ref)


def _plan_files(
    source: S3Source | LocalSource, opts: SyncOptions, report: SyncReport
) -> tuple[list[SourceFile], Manifest | None]:
    listing = source.list()
    manifest = _load_manifest(source, opts, report)
    if manifest is not None:
        files = _manifest_files(source, listing, manifest, opts)
    else:
        files = [
            SourceFile(path, listing[path].size, listing[path].etag, None, "none")
            for path in sorted(listing)
        ]
    if not files:
        raise SourceError(f"{source}: no files found", hint="check the bucket and prefix")
    return files, manifest


def _load_manifest(
    source: S3Source | LocalSource, opts: SyncOptions, report: SyncReport
) -> Manifest | None:
    """The manifest given (--manifest), else the one published with the source, else None."""
    if opts.manifest and opts.manifest != "none":
        given = load_manifest_ref(opts.manifest, opts.s3)
        report.manifest_origin = opts.manifest
        return given
    if opts.manifest != "none" and source.has_published_manifest:
        published = f"{str(source).rstrip('/')}/{MANIFEST_NAME}"
        manifest = Manifest.loads(source.read_small(MANIFEST_NAME), published)
        report.manifest_origin = f"published at {published}"
        return manifest
    return None


def _manifest_files(
    source: S3Source | LocalSource,
    listing: dict[str, Listed],
    manifest: Manifest,
    opts: SyncOptions,
) -> list[SourceFile]:
    """The manifest's files as listed in the source; a file missing or of another size there
    fails the sync, source files the manifest does not list are skipped with a warning."""
    files: list[SourceFile] = []
    problems = []
    for entry in manifest.files:
        listed = listing.get(entry.path)
        if listed is None:
            problems.append(f"{entry.path}: in the manifest but not in {source}")
        elif listed.size != entry.size:
            problems.append(
                f"{entry.path}: {listed.size} bytes in the source, manifest says {entry.size}"
            )
        else:
            files.append(SourceFile(entry.path, entry.size, listed.etag, entry.sha256, "manifest"))
    if problems:
        raise VerifyError(
            "source does not match the manifest:\n  " + "\n  ".join(problems),
            hint="the model changed after its manifest was built: rebuild and publish it",
        )
    extra = sorted(set(listing) - set(manifest.by_path()))
    if extra:
        opts.log(
            f"warning: {len(extra)} source files not in the manifest, skipped: "
            + ", ".join(extra[:5])
            + (" ..." if len(extra) > 5 else "")
        )
    return files


def _resolve_checksums(
    source: S3Source, files: list[SourceFile], listing_has: set[str], workers: int
) -> None:
    """Fill expected sha256 from S3 object checksums for files about to be fetched."""
    wanted = [f for f in files if f.path in listing_has]
    if not wanted:
        return

    def one(f: SourceFile) -> None:
        sha, version, _note = source.sha256_checksum(f.path)
        f.version_id = version
        if sha:
            f.expected_sha256 = sha
            f.verified_by = "s3-checksum"

    with ThreadPoolExecutor(max_workers=min(workers, 16)) as pool:
        list(pool.map(one, wanted))


def sync(src: str, dest: str, opts: SyncOptions) -> SyncReport:
    """Sync `src` (s3:// URL or directory) into `dest`; raise WeightsError on failure.

    report = sync("s3://models/x/", "/models/x", SyncOptions())
    """
    started = time.monotonic()
    if opts.part_size < 1 << 20:
        raise UsageError("--part-size must be at least 1MiB")
    report = SyncReport(source=src, dest=dest)
    source = open_source(src, opts.s3, on_retry=opts.log)
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise io_error(exc, dest, os.path.dirname(dest) or ".") from None
    directory = state_dir_for(dest, opts.state_dir)
    try:
        _sync_into(source, dest, directory, opts, report)
    except OSError as exc:
        raise io_error(exc, directory, dest) from None
    finally:
        report.seconds = time.monotonic() - started
        if isinstance(source, S3Source):
            report.source_requests = source.client.request_count
        elif isinstance(source, LocalSource):
            source.close()
    return report


def _classify(
    files: list[SourceFile], state: State, dest: str
) -> tuple[list[SourceFile], list[SourceFile], list[SourceFile]]:
    """(unchanged since the recorded verification, present with the right size: rehash, fetch)."""
    unchanged: list[SourceFile] = []
    rehash: list[SourceFile] = []
    fetch: list[SourceFile] = []
    for f in files:
        entry = state.files.get(f.path)
        try:
            st = os.lstat(os.path.join(dest, f.path))
        except (FileNotFoundError, NotADirectoryError):
            fetch.append(f)
            continue
        except OSError as exc:
            raise io_error(exc, os.path.join(dest, f.path), dest) from None
        if not stat.S_ISREG(st.st_mode):
            # a link (or anything but a file) at this name is replaced, never read through
            fetch.append(f)
            continue
        if (
            entry is not None
            and entry.matches_stat(st)
            and entry.etag == f.etag
            and (f.expected_sha256 is None or entry.sha256 == f.expected_sha256)
        ):
            if f.expected_sha256 is None:
                f.expected_sha256 = entry.sha256
                f.verified_by = entry.verified_by
            unchanged.append(f)
        elif st.st_size == f.size:
            rehash.append(f)
        else:
            fetch.append(f)
    return unchanged, rehash, fetch


@dataclass
class _Outcome:
    """What one sync found on disk and verified: sha256 + mtime and how, per path."""

    results: dict[str, tuple[str, int]] = field(default_factory=dict)
    verified_by: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def state(self, src: str, files: list[SourceFile]) -> State:
        """The state record: what is on disk and verified, even after failures."""
        state = State(source=src, manifest_digest=None)
        for f in files:
            if f.path in self.results:
                sha, mtime_ns = self.results[f.path]
                state.files[f.path] = FileState(
                    f.size, mtime_ns, sha, f.etag, self.verified_by.get(f.path, "none")
                )
        return state


@dataclass
class _Run:
    """One sync: where from, where to, where its state lives, its options and its report."""

    source: S3Source | LocalSource
    dest: str
    directory: str
    opts: SyncOptions
    report: SyncReport


def _sync_into(
    source: S3Source | LocalSource, dest: str, directory: str, opts: SyncOptions, report: SyncReport
) -> None:
    run = _Run(source, dest, directory, opts, report)
    src = report.source
    files, manifest = _plan_files(source, opts, report)
    state = State.load(directory)
    marker = read_marker(directory)
    unchanged, rehash, fetch = _classify(files, state, dest)
    report.files = len(files)
    report.unchanged = len(unchanged)
    if isinstance(source, S3Source) and manifest is None:
        # Only files that will be read need their S3 checksum: a no-op run sends no HEADs.
        listing_sha = {f.path for f in rehash + fetch}
        _resolve_checksums(source, rehash + fetch, listing_sha, opts.concurrency)
    # Files already on disk without a record are kept only if they hash to the known value.
    rehash_unknown = [f for f in rehash if f.expected_sha256 is None]
    rehash = [f for f in rehash if f.expected_sha256 is not None]
    fetch.extend(rehash_unknown)
    _check_integrity(fetch, opts)
    if rehash or fetch or (marker is not None and state.manifest_digest != marker):
        # The tree is about to change: no engine may start on it until the marker is back.
        remove_marker(directory)
    out = _Outcome()
    for f in unchanged:
        entry = state.files[f.path]
        out.results[f.path] = (entry.sha256, entry.mtime_ns)
        out.verified_by[f.path] = f.verified_by
    _rehash_existing(dest, rehash, fetch, out)
    report.rehashed = len(rehash) - sum(1 for f in rehash if f in fetch)
    fetch.sort(key=lambda f: f.path)
    if fetch:
        report.fetched = len(fetch)
        try:
            _fetch(run, fetch, out)
        except WeightsError:
            out.state(src, files).save(directory)
            raise
    for kind in out.verified_by.values():
        report.verified_by[kind] = report.verified_by.get(kind, 0) + 1
    if out.failures:
        report.errors = out.failures
        remove_marker(directory)
        out.state(src, files).save(directory)
        raise VerifyError(
            f"{len(out.failures)} file(s) failed verification, nothing marked verified:\n  "
            + "\n  ".join(out.failures)
        )
    _mark_verified(run, files, manifest, out)


def _check_integrity(fetch: list[SourceFile], opts: SyncOptions) -> None:
    """Refuse, before a byte is written, files with no sha256 to check against unless the
    integrity opt-out (--allow-size-etag) is given; then say which are taken on size + ETag."""
    no_sha = sorted(f.path for f in fetch if f.expected_sha256 is None)
    if opts.require_sha256 and no_sha:
        # nothing could tell a tampered file from a good one
        raise VerifyError(
            f"{len(no_sha)} file(s) have no sha256 to check against (no published manifest, "
            f"no S3 object checksum): {', '.join(no_sha[:5])}; nothing was downloaded",
            hint="publish a manifest with `hgxserve weights manifest SRC --publish`, or opt "
            "out explicitly with --allow-size-etag (model.integrity: size-etag)",
        )
    if no_sha:
        opts.log(
            f"warning: integrity opt-out: {len(no_sha)} file(s) will be accepted on size + "
            "ETag only, without sha256 (--allow-size-etag)"
        )


def _mark_verified(
    run: _Run, files: list[SourceFile], manifest: Manifest | None, out: _Outcome
) -> None:
    """Every file verified: keep the manifest (published or derived), write state and marker."""
    dest, directory, opts, report = run.dest, run.directory, run.opts, run.report
    src = report.source
    effective = manifest
    if effective is None:
        effective = Manifest(
            files=[
                ManifestFile(f.path, f.size, out.results[f.path][0], f.etag, f.version_id)
                for f in files
            ],
            source=src,
            extra={"derived": True},
        )
        report.manifest_origin = "derived from this sync's own sha256 (no published manifest)"
    report.manifest_digest = effective.digest
    new_state = out.state(src, files)
    new_state.manifest_digest = effective.digest
    unverified = [p for p, k in out.verified_by.items() if k == "none"]
    save_manifest_copy(directory, effective)
    _place_manifest(dest, effective)
    new_state.save(directory)
    if opts.require_sha256 and unverified:
        remove_marker(directory)
        raise VerifyError(
            f"{len(unverified)} file(s) have no sha256 to check against (no manifest, no S3 "
            f"checksum): {', '.join(unverified[:5])}",
            hint="publish a manifest with `hgxserve weights manifest SRC --publish`, or opt "
            "out explicitly with --allow-size-etag (model.integrity: size-etag)",
        )
    if opts.require_complete:
        check_complete(dest, [f.path for f in effective.files], directory)
    if read_marker(directory) != effective.digest:
        write_marker(directory, effective.digest)
    report.marker = True
    _warn_extra(dest, effective, opts)


def _rehash_existing(
    dest: str, rehash: list[SourceFile], fetch: list[SourceFile], out: _Outcome
) -> None:
    """Hash the files already in dest: a match is verified, the rest joins `fetch`."""
    if not rehash:
        return

    def one(f: SourceFile) -> None:
        path = os.path.join(dest, f.path)
        sha = sha256_file(path)
        if sha == f.expected_sha256:
            out.results[f.path] = (sha, os.stat(path).st_mtime_ns)
            out.verified_by[f.path] = f.verified_by
        else:
            fetch.append(f)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(one, rehash))


def _engine_for(
    source: S3Source | LocalSource, opts: SyncOptions
) -> tuple[native.Engine | None, str]:
    """(s5cmd when it will be used, else None; why not, for the report)."""
    if opts.engine == "python":
        return None, "--engine python"
    if not isinstance(source, S3Source):
        return None, "local source"
    engine = native.find_engine()
    reason = native.unsupported_reason(source) if engine else "s5cmd is not installed"
    if reason and opts.engine == "s5cmd":
        raise UsageError(f"--engine s5cmd cannot be used: {reason}")
    return (None, reason) if reason else (engine, "")


def _native_fits(f: SourceFile, dest: str, opts: SyncOptions) -> bool:
    """Whether s5cmd fetches this file.

    Only files with a sha256 to check (files accepted on size + ETag keep the in-process engine's
    If-Match pinning to the listed version). s5cmd resumes whole files only, so a file of several
    parts below `native_min_size` and a file with parts already recorded by the in-process engine
    stay with it (it resumes part by part); a file of one part, or a large one, goes to s5cmd,
    which costs less CPU per file and per byte (docs/weights.md "Transfer engines").
    """
    if f.size == 0 or f.expected_sha256 is None:
        return False
    if opts.part_size < f.size < opts.native_min_size:
        return False
    return not os.path.lexists(os.path.join(dest, f.path) + PARTS_SUFFIX)


def _describe_engines(engine: native.Engine | None, n_native: int, n_python: int, why: str) -> str:
    parts = []
    if engine is not None and n_native:
        parts.append(f"s5cmd {engine.version} ({n_native} files)")
    if n_python:
        note = f"; {why}" if why and not n_native else ""
        parts.append(f"python ({n_python} files{note})")
    return " + ".join(parts)


def _fetch(run: _Run, fetch: list[SourceFile], out: _Outcome) -> None:
    opts = run.opts
    total = sum(f.size for f in fetch)
    progress = Progress("sync", total, len(fetch), quiet=opts.quiet)
    engine, why = _engine_for(run.source, opts)
    by_native = [f for f in fetch if engine is not None and _native_fits(f, run.dest, opts)]
    by_python = [f for f in fetch if f not in by_native]
    run.report.engine = _describe_engines(engine, len(by_native), len(by_python), why)
    fetcher = _Fetcher(run, out, progress, engine)
    try:
        # Side by side: the small files' requests and fsyncs overlap s5cmd's large transfers.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="native") as side:
            pending = side.submit(fetcher.group, by_native, True) if by_native else None
            try:
                if by_python:
                    fetcher.group(by_python, False)
            except BaseException:
                # this error (or Ctrl-C) is the one to report; the other engine just stops
                if pending is not None:
                    with contextlib.suppress(Exception):
                        pending.result()
                raise
            if pending is not None:
                pending.result()
    finally:
        progress.close()


class _Fetcher:
    """Runs a transfer engine over a group of files and records each file's outcome."""

    def __init__(
        self, run: _Run, out: _Outcome, progress: Progress, engine: native.Engine | None
    ) -> None:
        self.run = run
        self.out = out
        self.progress = progress
        self.engine = engine
        self.lock = threading.Lock()
        opts = run.opts
        self.options = TransferOptions(
            opts.concurrency, opts.part_size, progress, opts.fsync, self.on_file, opts.log
        )

    def on_file(self, result: FileResult) -> None:
        with self.lock:
            self.run.report.bytes_fetched += result.downloaded
            self.run.report.bytes_resumed += result.resumed
            if result.error is None and result.sha256 is not None:
                self.out.results[result.file.path] = (result.sha256, result.mtime_ns)
                self.out.verified_by[result.file.path] = result.file.verified_by

    def transfer(self, files: list[SourceFile], use_native: bool) -> list[FileResult]:
        source, dest = self.run.source, self.run.dest
        if use_native and self.engine is not None and isinstance(source, S3Source):
            return native.NativeTransfer(self.engine, source, dest, files, self.options).run()
        return Transfer(source, dest, files, self.options).run()

    def group(self, files: list[SourceFile], use_native: bool) -> None:
        """Fetch the files; a resumed file that does not verify is fetched afresh once."""
        retry: list[SourceFile] = []
        for result in self.transfer(files, use_native):
            if result.error is None:
                continue
            if result.resumed:
                # The resumed bytes were bad (e.g. written before a crash): fetch afresh once.
                retry.append(result.file)
            else:
                self.out.failures.append(str(result.error))
        if retry:
            self.run.opts.log(f"{len(retry)} resumed file(s) did not verify; fetching them afresh")
            self.out.failures.extend(
                str(r.error) for r in self.transfer(retry, use_native) if r.error
            )


def _warn_extra(dest: str, manifest: Manifest, opts: SyncOptions) -> None:
    """Name files in DEST that the manifest does not list (left alone, never deleted)."""
    known = set(manifest.by_path())
    extra = []
    for dirpath, dirnames, filenames in os.walk(dest):
        dirnames[:] = [d for d in dirnames if d not in (".hgxserve", native.STAGING_DIR)]
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), dest).replace(os.sep, "/")
            if rel not in known and rel != MANIFEST_NAME:
                extra.append(rel)
    if extra:
        extra.sort()
        opts.log(
            f"warning: {len(extra)} file(s) in {dest} are not in the manifest: "
            + ", ".join(extra[:5])
            + (" ..." if len(extra) > 5 else "")
        )


def _place_manifest(dest: str, manifest: Manifest) -> None:
    """Keep DEST/hgxserve-manifest.json equal to the manifest the tree was verified against
    (cache keys and engines read the model's manifest from the model directory)."""
    write_if_changed(os.path.join(dest, MANIFEST_NAME), manifest.dumps())
