"""The download engine: parallel ranged reads across and within files, sha256 while downloading.

Parts go through one queue to `concurrency` worker threads, a few of the largest files at a time
with their parts interleaved (see _part_order). A worker takes a buffer from a bounded pool and
fetches one part into it (ranged GET or pread); each slice is written to `<file>.partial` with
pwrite as soon as it lands, while it is still in the CPU cache. A finished part is handed to the
kernel for writeback (so the fsync before the rename has little left to wait for), recorded in
`<file>.partial.parts`, and its buffer goes to the file's in-order hasher; whichever worker
completes the part the hash is waiting for hashes every buffered part that follows (hashlib
releases the GIL, so hashing runs on the second core while other workers download). Because each
file's parts leave the queue in offset order, the part a file's hash waits for is always already
in flight, so the bounded pool cannot deadlock. A file is renamed into place only after its hash
matches; a resumed file re-reads its recorded parts from the .partial instead of downloading
them again.

    engine = Transfer(source, "/models/x", files, TransferOptions(concurrency=16))
    results = engine.run()
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hgxserve.base.defaults import S3_CONCURRENCY, S3_PART_SIZE_BYTES
from hgxserve.weights.errors import LocalIOError, SourceError, VerifyError, WeightsError
from hgxserve.weights.progress import Progress
from hgxserve.weights.safefs import (
    READ,
    READ_WRITE,
    WRITE_NEW,
    libc_function,
    open_in,
    open_parent,
)

PARTIAL_SUFFIX = ".partial"
PARTS_SUFFIX = ".partial.parts"


@dataclass
class SourceFile:
    """One file to bring over, with what it must hash to (when known)."""

    path: str  # relative path in the tree
    size: int
    etag: str  # S3 ETag, or "size:mtime_ns" for a local source
    expected_sha256: str | None = None
    verified_by: str = "none"  # manifest | s3-checksum | none
    version_id: str | None = None


# on_data(start, end): bytes [start, end) of the part's buffer have landed
OnData = Callable[[int, int], None]


class Source(Protocol):
    """Where parts come from."""

    def describe(self, f: SourceFile) -> str: ...

    def fetch_into(
        self, f: SourceFile, offset: int, buf: memoryview, on_data: OnData | None = None
    ) -> None:
        """Fill `buf` with bytes [offset, offset+len(buf)) of `f`, calling `on_data(start, end)`
        for each slice as it lands (possibly again for the same range after a retry)."""


@dataclass
class FileResult:
    """Outcome of one file."""

    file: SourceFile
    sha256: str | None = None
    mtime_ns: int = 0
    error: WeightsError | None = None
    downloaded: int = 0
    resumed: int = 0


# Page-cache writes are issued in slices of this size, each right after it arrived. Measured on
# the 2-core test VM (Linux 6.18, ext4, memory handed back to the host after a few seconds), the
# kernel copy into the page cache costs several times more for large writes from a buffer that
# has left the CPU cache: 1 GiB in 8 MiB pwrites 1.3-2.8 s sys, in 64 KiB slices 0.3-1.2 s; a
# whole sync went from ~3.3 to ~1.2 s sys when parts were written slice by slice as they came in.
WRITE_SLICE = 64 << 10


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view[:WRITE_SLICE], offset)
        view = view[n:]
        offset += n


_SYNC_FILE_RANGE = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a finished part to disk now, without waiting for it.

    The fsync before the rename then only waits for the last parts instead of the whole file:
    with every file finishing near the end of a sync, the fsyncs were a serial tail of ~0.5 s
    per GiB. Best effort; the fsync is what makes the file durable.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise SourceError(f"{what}: file ended early (was it truncated while being read?)")
        view = view[n:]
        offset += n


def io_error(exc: OSError, what: str, dest: str) -> WeightsError:
    """A clear LocalIOError for an OSError on the destination.

    raise io_error(exc, "/models/x/a.safetensors.partial", "/models/x")
    """
    if exc.errno == errno.ENOSPC:
        try:
            st = os.statvfs(dest)
            free = f"; {st.f_bavail * st.f_frsize} bytes free on {dest}"
        except OSError:
            free = ""
        return LocalIOError(
            f"disk full writing {what}{free}; the file stays as .partial and is not marked "
            "verified",
            hint="free space (the model needs its full size on the destination) and run again",
        )
    if exc.errno == errno.EROFS:
        return LocalIOError(f"{what}: destination is read-only")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return LocalIOError(f"{what}: permission denied")
    return LocalIOError(f"{what}: {exc.strerror or exc}")


class _BufferPool:
    """At most `limit` part buffers of `size` bytes (the largest part of the transfer), allocated
    on first use and then reused."""

    def __init__(self, limit: int, size: int) -> None:
        self._free: list[bytearray] = []
        self._sem = threading.Semaphore(limit)
        self._lock = threading.Lock()
        self._size = size

    def get(self) -> bytearray:
        self._sem.acquire()
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self._size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
        self._sem.release()


class _Job:
    """One file in flight: its .partial, the parts log, and the in-order hasher."""

    def __init__(self, f: SourceFile, dest: str, part_size: int) -> None:
        self.f = f
        self.dest = dest
        self.final = os.path.join(dest, f.path)
        self.partial = self.final + PARTIAL_SUFFIX
        self.parts_log = self.final + PARTS_SUFFIX
        # names inside the parent directory, used with dir_fd: no link in the tree is followed
        self.name = os.path.basename(f.path)
        self.partial_name = self.name + PARTIAL_SUFFIX
        self.parts_name = self.name + PARTS_SUFFIX
        self.dir_fd: int | None = None
        self.part_size = part_size
        self.fd: int | None = None
        self.log_fd: int | None = None
        self.hasher = hashlib.sha256()
        self.next_offset = 0
        self.pending: dict[int, tuple[memoryview, bytearray]] = {}
        self.hashing = False
        self.lock = threading.Lock()
        self.result = FileResult(f)
        self.done_parts: set[int] = set()
        self.closed = False
        self.ready = False

    def header(self) -> dict[str, object]:
        return {"etag": self.f.etag, "size": self.f.size, "part_size": self.part_size}

    def open(self, dest: str) -> None:
        """Open or resume the .partial; fills done_parts from a matching parts log."""
        try:
            self.dir_fd = open_parent(dest, self.f.path, create=True)
            self.done_parts = self._read_parts_log()
            fd: int | None = None
            if self.done_parts:
                with contextlib.suppress(FileNotFoundError):
                    fd = open_in(self.dir_fd, self.partial_name, READ_WRITE, dest, self.f.path)
            if fd is not None:
                self.fd = fd
                if os.fstat(fd).st_size != self.f.size:
                    self.done_parts = set()
            else:
                self.done_parts = set()
                self.fd = open_in(self.dir_fd, self.partial_name, WRITE_NEW, dest, self.f.path)
            if not self.done_parts:
                _reserve(self.fd, self.f.size)
                log = open_in(self.dir_fd, self.parts_name, WRITE_NEW, dest, self.f.path)
                try:
                    os.write(log, (json.dumps(self.header(), sort_keys=True) + "\n").encode())
                finally:
                    os.close(log)
            self.log_fd = open_in(
                self.dir_fd, self.parts_name, os.O_WRONLY | os.O_APPEND, dest, self.f.path
            )
        except OSError as exc:
            self.close_fds()
            raise io_error(exc, self.partial, dest) from None
        except LocalIOError:
            self.close_fds()
            raise

    def _read_parts_log(self) -> set[int]:
        assert self.dir_fd is not None
        try:
            fd = open_in(self.dir_fd, self.parts_name, READ, self.dest, self.f.path)
        except OSError:
            return set()
        with os.fdopen(fd, encoding="utf-8") as fh:
            try:
                lines = fh.read().split("\n")
            except (OSError, ValueError):
                return set()
        try:
            if json.loads(lines[0]) != json.loads(json.dumps(self.header())):
                return set()
        except ValueError:
            return set()
        done = set()
        # The last line may be cut by a kill; only complete lines count.
        for line in lines[1:-1]:
            if line.isdigit():
                done.add(int(line))
        return done

    def unlink_partial(self) -> None:
        for name in (self.partial_name, self.parts_name):
            with contextlib.suppress(OSError):
                if self.dir_fd is not None:
                    os.unlink(name, dir_fd=self.dir_fd)

    def place(self) -> int:
        """Rename the .partial over the final name (a link there is replaced, never followed);
        return the new file's mtime_ns."""
        assert self.dir_fd is not None
        d = self.dir_fd
        os.replace(self.partial_name, self.name, src_dir_fd=d, dst_dir_fd=d)
        os.unlink(self.parts_name, dir_fd=d)
        return os.stat(self.name, dir_fd=d, follow_symlinks=False).st_mtime_ns

    def record_part(self, offset: int) -> None:
        assert self.log_fd is not None
        os.write(self.log_fd, f"{offset}\n".encode())

    def close_fds(self, *, keep_dir: bool = False) -> None:
        self.closed = True
        for name in ("fd", "log_fd") if keep_dir else ("fd", "log_fd", "dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, None)


def _reserve(fd: int, size: int) -> None:
    # Reserve the blocks up front: a full disk fails here, before any byte is fetched.
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, size)
        else:
            raise


def _part_order(jobs: list[_Job], part_size: int, streams: int) -> list[tuple[_Job, int]]:
    """The order parts enter the queue: `streams` files at a time, their parts interleaved.

    Large files go first: their parts keep every connection streaming, and small files fill the
    gaps while the last big parts are in flight. Interleaving several files keeps several
    in-order hashes advancing at once (one file at a time leaves one hashing thread for all
    connections: buffers pile up behind it and the pool runs dry). Each file's parts still
    enter in offset order, which is what keeps the bounded pool free of deadlock.

        _part_order(jobs, 8 << 20, 4)[:3]  # [(a, 0), (b, 0), (c, 0)]
    """
    pending = [j for j in sorted(jobs, key=lambda j: (-j.f.size, j.f.path)) if j.f.size > 0]
    pending.reverse()  # pop() takes the largest next
    active: list[tuple[_Job, int]] = []  # (job, next offset)
    order: list[tuple[_Job, int]] = []
    while pending or active:
        while pending and len(active) < streams:
            active.append((pending.pop(), 0))
        still: list[tuple[_Job, int]] = []
        for job, offset in active:
            order.append((job, offset))
            if offset + part_size < job.f.size:
                still.append((job, offset + part_size))
        active = still
    return order


def _log_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class TransferOptions:
    """How an engine fetches: requests in flight, bytes per ranged request, the progress meter,
    whether parts and files are pushed to disk, who hears of each finished file, where notes
    go."""

    concurrency: int = S3_CONCURRENCY
    part_size: int = S3_PART_SIZE_BYTES
    progress: Progress | None = None
    fsync: bool = True
    on_file: Callable[[FileResult], None] | None = None
    log: Callable[[str], None] = field(default=_log_line)


class Transfer:
    """Fetch `files` from `source` into `dest` with inline sha256 and resumable .partial files."""

    def __init__(
        self,
        source: Source,
        dest: str,
        files: list[SourceFile],
        options: TransferOptions | None = None,
    ) -> None:
        options = options or TransferOptions()
        self.source = source
        self.dest = dest
        self.files = files
        self.part_size = part_size = options.part_size
        # No more workers than parts, and no buffer larger than the largest part: each worker
        # holds a buffer while it waits for a part, and a buffer is zero-filled (resident) when
        # it is made, so 32 workers of 32 MiB took 1 GiB to sync a 3 KB tree.
        parts = sum(-(-f.size // part_size) for f in files)
        self.concurrency = max(1, min(options.concurrency, parts))
        largest = max((f.size for f in files), default=0)
        self.buffer_size = max(1, min(part_size, largest))
        self.progress = options.progress
        self.fsync = options.fsync
        self.on_file = options.on_file
        # Files hashed side by side: enough to keep both cores of a small host hashing, few
        # enough that each file has several parts in flight and its hash rarely waits.
        self.hash_streams = max(1, min(4, self.concurrency // 4))
        self.pool = _BufferPool(self.concurrency + max(2, self.concurrency // 4), self.buffer_size)
        self.queue: queue.Queue[tuple[_Job, int, int, bool] | None] = queue.Queue()
        self.fatal: WeightsError | None = None
        self._fatal_lock = threading.Lock()
        self.results: list[FileResult] = []
        self._remaining = 0
        self._remaining_lock = threading.Lock()
        self._all_done = threading.Event()

    def run(self) -> list[FileResult]:
        jobs = [_Job(f, self.dest, self.part_size) for f in self.files]
        self._remaining = len(jobs)
        for job, offset in _part_order(jobs, self.part_size, self.hash_streams):
            length = min(self.part_size, job.f.size - offset)
            self.queue.put((job, offset, length, False))
        self._finish_empty(jobs)
        if self._remaining == 0:
            self._all_done.set()
        workers = [
            threading.Thread(target=self._worker, name=f"fetch-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        for w in workers:
            w.start()
        try:
            while not self._all_done.wait(0.2):
                if self.fatal is not None and all(not w.is_alive() for w in workers):
                    break
        finally:
            self._stop(workers, jobs)
        if self.fatal is not None:
            raise self.fatal
        self.results = [job.result for job in jobs]
        return self.results

    def _finish_empty(self, jobs: list[_Job]) -> None:
        """Empty files have no part to fetch: create and finish them now."""
        for job in jobs:
            if job.f.size != 0:
                continue
            try:
                self._ensure_open(job)
            except WeightsError as exc:
                self._set_fatal(exc)
                return
            self._finish(job)

    def _stop(self, workers: list[threading.Thread], jobs: list[_Job]) -> None:
        """End the workers (dropping the parts still queued after a failure); close the files."""
        for _ in workers:
            self.queue.put(None)
        if self.fatal is not None or not self._all_done.is_set():
            self._drain()
        for w in workers:
            w.join(timeout=30)
        for job in jobs:
            job.close_fds()

    def _ensure_open(self, job: _Job) -> bool:
        """Open (or resume) the job's .partial on first use; True once it is open."""
        if job.ready:
            return True
        with job.lock:
            if not job.ready and not job.closed:
                job.open(self.dest)
                # Published only after both descriptors exist: other workers skip the lock.
                job.ready = True
        return job.ready

    def _drain(self) -> None:
        try:
            while True:
                item = self.queue.get_nowait()
                if item is None:
                    self.queue.put(None)
                    return
        except queue.Empty:
            return

    def _set_fatal(self, exc: WeightsError) -> None:
        with self._fatal_lock:
            if self.fatal is None:
                self.fatal = exc
        self._all_done.set()

    def _worker(self) -> None:
        while True:
            buf = self.pool.get()
            item = self.queue.get()
            if item is None or self.fatal is not None:
                self.pool.put(buf)
                if item is None:
                    return
                continue
            job, offset, length, _ = item
            if job.result.error is not None:
                self.pool.put(buf)
                continue
            view = memoryview(buf)[:length]
            try:
                self._fill(job, offset, view)
            except WeightsError as exc:
                self.pool.put(buf)
                if isinstance(exc, VerifyError):
                    self._fail_job(job, exc)
                else:
                    self._set_fatal(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a worker must never die silently
                self.pool.put(buf)
                self._set_fatal(SourceError(f"{self.source.describe(job.f)}: {exc!r}"))
                continue
            self._deliver(job, offset, view, buf)

    def _fill(self, job: _Job, offset: int, view: memoryview) -> None:
        """Bring one part into `view`: from the .partial when an earlier run kept it, else from
        the source (written to the .partial slice by slice as it lands)."""
        length = len(view)
        if self._ensure_open(job) and offset in job.done_parts:
            assert job.fd is not None
            _pread_exact(job.fd, view, offset, job.partial)
            job.result.resumed += length
            return
        self.source.fetch_into(job.f, offset, view, self._slice_writer(job, view, offset))
        try:
            if self.fsync and job.fd is not None:
                start_writeback(job.fd, offset, length)
            job.record_part(offset)
        except OSError as exc:
            raise io_error(exc, job.partial, self.dest) from None
        job.result.downloaded += length
        if self.progress:
            self.progress.add(length)

    def _slice_writer(self, job: _Job, view: memoryview, offset: int) -> OnData:
        """Write each slice of a part to the .partial as it arrives, still in the CPU cache.

        Writing a whole part after it has landed costs several times the kernel time on a VM
        (cold source, large page-cache folios; see WRITE_SLICE).
        """
        fd = job.fd
        assert fd is not None

        def write_slice(start: int, end: int) -> None:
            try:
                _pwrite_all(fd, view[start:end], offset + start)
            except OSError as exc:
                raise io_error(exc, job.partial, self.dest) from None

        return write_slice

    def _deliver(self, job: _Job, offset: int, view: memoryview, buf: bytearray) -> None:
        with job.lock:
            if job.result.error is not None:
                self.pool.put(buf)
                return
            job.pending[offset] = (view, buf)
            if job.hashing:
                return
            job.hashing = True
        while True:
            with job.lock:
                item = job.pending.pop(job.next_offset, None)
                if item is None or job.result.error is not None:
                    job.hashing = False
                    if item is not None:
                        self.pool.put(item[1])
                    return
            part_view, part_buf = item
            job.hasher.update(part_view)
            job.next_offset += len(part_view)
            self.pool.put(part_buf)
            if job.next_offset >= job.f.size:
                with job.lock:
                    job.hashing = False
                self._finish(job)
                return

    def _fail_job(self, job: _Job, exc: WeightsError) -> None:
        with job.lock:
            job.result.error = exc
            for _, buf in job.pending.values():
                self.pool.put(buf)
            job.pending.clear()
        self._job_done(job)

    def _finish(self, job: _Job) -> None:
        digest = job.hasher.hexdigest()
        job.result.sha256 = digest
        expected = job.f.expected_sha256
        if expected is not None and digest != expected:
            job.close_fds(keep_dir=True)
            # Never keep content known to be wrong: the next run starts this file afresh.
            job.unlink_partial()
            job.close_fds()
            what = "the manifest" if job.f.verified_by == "manifest" else "its S3 checksum"
            job.result.error = VerifyError(
                f"{job.f.path}: sha256 {digest} does not match {what} ({expected}); "
                "the file was not kept"
            )
            self._job_done(job)
            return
        try:
            assert job.fd is not None
            if self.fsync:
                os.fsync(job.fd)
            job.close_fds(keep_dir=True)
            job.result.mtime_ns = job.place()
        except OSError as exc:
            job.close_fds()
            self._set_fatal(io_error(exc, job.final, self.dest))
            return
        job.close_fds()
        self._job_done(job)

    def _job_done(self, job: _Job) -> None:
        if self.progress:
            self.progress.file_done()
        if self.on_file:
            self.on_file(job.result)
        with self._remaining_lock:
            self._remaining -= 1
            if self._remaining == 0:
                self._all_done.set()
