"""Content-addressed cache archives: deterministic tar + zstd, a manifest, verified atomic restore.

An archive is a POSIX tar stream compressed with zstd. Entries come in sorted path order with
mtime 0, uid/gid 0 and no owner names, so the same tree always gives the same bytes and the same
sha256; the archive file is named `<sha256>.tar.zst`. The last member is `.hgxserve-manifest.json`:
every file with its size, mode and sha256, every directory and symlink. Restore unpacks into a
temporary sibling directory, checks every file against the manifest (and the archive against its
sha256 when known), and only then swaps it into place, so a bad archive leaves the old cache as
it was.

    >>> result = pack_dir("/var/cache/hgxserve/3f2a", "/srv/caches/")  # doctest: +SKIP
    >>> restore_archive(result.path, "/var/cache/hgxserve/3f2a")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, cast

import jsonschema
import zstandard

from hgxserve.base.cachelayout import (
    MANIFEST_NAME,
    MAX_RESTORE_BYTES,
    MAX_RESTORE_ENTRIES,
    RESTORE_MARKER,
    read_marker,
    valid_key,
)
from hgxserve.base.errors import HgxserveError

FORMAT = "hgxserve-cache/1"
ZSTD_LEVEL = 3
# zstd's multi-threaded mode gives the same bytes for any worker count >= 1, so archives are
# identical on a 2-core controller and a 192-core host.
ZSTD_THREADS = -1
COPY_BUFSIZE = 1 << 20
DIGEST_NAME = re.compile(r"^([0-9a-f]{64})\.tar\.zst$")


class ArchiveError(HgxserveError):
    """A pack or restore that cannot go on; the message says what and where."""


@dataclass
class PackResult:
    path: str
    sha256: str
    manifest_sha256: str
    files: int
    bytes: int
    archive_bytes: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "archive": self.path,
            "sha256": self.sha256,
            "manifest_sha256": self.manifest_sha256,
            "files": self.files,
            "bytes": self.bytes,
            "archive_bytes": self.archive_bytes,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class RestoreResult:
    dir: str
    sha256: str | None
    manifest_sha256: str
    files: int
    bytes: int
    changed: bool
    seconds: float
    replaced: bool = False
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dir": self.dir,
            "sha256": self.sha256,
            "manifest_sha256": self.manifest_sha256,
            "files": self.files,
            "bytes": self.bytes,
            "changed": self.changed,
            "replaced": self.replaced,
            "seconds": round(self.seconds, 3),
        }


class _Hashing(io.RawIOBase):
    """Counts and hashes the bytes that pass through it."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.hasher = hashlib.sha256()
        self.count = 0

    def _passed(self, data: bytes | memoryview) -> None:
        self.hasher.update(data)
        self.count += len(data)


class _HashingWriter(_Hashing):
    """Counts and hashes bytes on their way to a file."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._passed(view)
        self.fh.write(view)
        return len(view)


class _HashingReader(_Hashing):
    """Hashes a file while tarfile copies it into the archive (one read per file)."""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self._passed(data)
        return data


def _tarinfo(name: str, kind: bytes, mode: int, size: int = 0, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.linkname = target
    return info


def _normal_mode(st_mode: int, is_dir: bool) -> int:
    # Only "executable or not" survives: owners and umasks differ between hosts.
    return 0o755 if is_dir or st_mode & 0o111 else 0o644


def _walk(src: str) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Sorted (dirs, files, symlinks) relative to src; host-local state files left out."""
    dirs: list[str] = []
    files: list[str] = []
    links: list[tuple[str, str]] = []
    for top, subdirs, names in os.walk(src, followlinks=False):
        rel_top = os.path.relpath(top, src)
        for name in list(subdirs) + names:
            rel = name if rel_top == "." else posixpath.join(rel_top, name)
            if rel == MANIFEST_NAME or rel.split("/")[0].startswith(RESTORE_MARKER):
                continue  # the host's marker (and its temporaries): a restore refuses them
            full = os.path.join(src, rel)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(full)
                if not _link_stays_inside(rel, target) or not _resolves_inside(src, rel):
                    raise ArchiveError(
                        f"{full}: symlink to {target!r} points outside the cache dir"
                    )
                links.append((rel, target))
            elif stat.S_ISDIR(st.st_mode):
                dirs.append(rel)
            elif stat.S_ISREG(st.st_mode):
                files.append(rel)
            else:
                raise ArchiveError(f"{full}: not a file, directory or symlink; refusing to pack it")
    return sorted(dirs), sorted(files), sorted(links)


def _resolves_inside(root: str, rel: str) -> bool:
    """True when `root/rel`, with every link on the way resolved (chains included), stays in
    `root`: `a -> b/..` next to `b -> ..` passes a per-link check but leaves the tree."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    return real == real_root or real.startswith(real_root + os.sep)


def _link_stays_inside(rel: str, target: str) -> bool:
    if target.startswith("/"):
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return not (joined == ".." or joined.startswith("../"))


def pack_dir(src: str, out: str, key: str | None = None, level: int = ZSTD_LEVEL) -> PackResult:
    """Pack a cache key directory into `<out>/<sha256>.tar.zst` (or exactly `out` if *.tar.zst).

    >>> pack_dir("/var/cache/hgxserve/3f2a", "/srv/caches/").sha256  # doctest: +SKIP
    'c0ffee...'
    """
    started = time.monotonic()
    if not os.path.isdir(src):
        raise ArchiveError(f"{src}: no such cache directory")
    src = os.path.abspath(src)
    dirs, files, links = _walk(src)
    # An explicit *.tar.zst is the archive's path; anything else is the folder it goes into.
    out_is_dir = os.path.isdir(out) or not out.endswith(".tar.zst")
    out_dir = out if out_is_dir else (os.path.dirname(os.path.abspath(out)) or ".")
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pack-", suffix=".tmp", dir=out_dir)
    entries: list[dict[str, Any]] = []
    total = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            hashed = _HashingWriter(raw)
            cctx = zstandard.ZstdCompressor(level=level, threads=ZSTD_THREADS)
            with (
                cctx.stream_writer(cast(BinaryIO, hashed), closefd=False) as zst,
                tarfile.open(  # type: ignore[call-overload]
                    fileobj=zst, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=COPY_BUFSIZE
                ) as tar,
            ):
                ordered = sorted(
                    [(d, "dir") for d in dirs]
                    + [(f, "file") for f in files]
                    + [(n, "link") for n, _ in links]
                )
                targets = dict(links)
                for rel, kind in ordered:
                    full = os.path.join(src, rel)
                    if kind == "dir":
                        tar.addfile(_tarinfo(rel, tarfile.DIRTYPE, 0o755))
                    elif kind == "link":
                        tar.addfile(_tarinfo(rel, tarfile.SYMTYPE, 0o777, target=targets[rel]))
                    else:
                        with open(full, "rb") as fh:
                            st = os.fstat(fh.fileno())
                            mode = _normal_mode(st.st_mode, False)
                            reader = _HashingReader(fh)
                            tar.addfile(_tarinfo(rel, tarfile.REGTYPE, mode, st.st_size), reader)
                            if reader.count != st.st_size:
                                raise ArchiveError(f"{full}: changed size while being packed")
                        entries.append(
                            {
                                "path": rel,
                                "size": st.st_size,
                                "mode": f"{mode:o}",
                                "sha256": reader.hasher.hexdigest(),
                            }
                        )
                        total += st.st_size
                manifest = {
                    "format": FORMAT,
                    "key": key or os.path.basename(src.rstrip("/")),
                    "files": entries,
                    "dirs": dirs,
                    "symlinks": [{"path": n, "target": t} for n, t in links],
                    "total_bytes": total,
                }
                body = json.dumps(manifest, sort_keys=True, indent=1).encode() + b"\n"
                tar.addfile(
                    _tarinfo(MANIFEST_NAME, tarfile.REGTYPE, 0o644, len(body)), io.BytesIO(body)
                )
                tar.close()
        digest = hashed.hasher.hexdigest()
        final = os.path.join(out_dir, f"{digest}.tar.zst") if out_is_dir else out
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return PackResult(
        path=final,
        sha256=digest,
        manifest_sha256=hashlib.sha256(body).hexdigest(),
        files=len(entries),
        bytes=total,
        archive_bytes=hashed.count,
        seconds=time.monotonic() - started,
    )


def sha256_of(path: str) -> str:
    """sha256 hex of a whole file."""
    hasher = hashlib.sha256()
    buf = bytearray(COPY_BUFSIZE)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


def expected_digest(archive: str, given: str | None) -> str | None:
    """The sha256 the archive must have: the one given, else the one in its `<sha256>` name."""
    if given:
        if not re.fullmatch(r"[0-9a-f]{64}", given):
            raise ArchiveError(f"--sha256 {given!r} is not 64 lowercase hex digits")
        return given
    match = DIGEST_NAME.match(os.path.basename(archive))
    return match.group(1) if match else None


def write_marker(dest: str, marker: dict[str, Any]) -> None:
    """Write dest's restore marker atomically, through a fresh temporary file (whatever an
    archive left in dest, even an entry named like a temporary, is never written through)."""
    fd, tmp = tempfile.mkstemp(prefix=RESTORE_MARKER + ".", suffix=".tmp", dir=dest)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(marker, fh, sort_keys=True, indent=1)
            fh.write("\n")
        os.replace(tmp, os.path.join(dest, RESTORE_MARKER))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _safe_member_name(name: str) -> str:
    clean = name[2:] if name.startswith("./") else name
    clean = clean.rstrip("/")
    parts = clean.split("/")
    if (
        not clean
        or clean.startswith("/")
        or "\\" in clean
        or "\x00" in clean
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ArchiveError(f"unsafe path in archive: {name!r} (absolute or with '..'); refusing it")
    return clean


class _Unpacker:
    """One restore's unpack into tmp: the caps still left and what it has written so far."""

    def __init__(self, archive: str, tmp: str, max_bytes: int) -> None:
        self.archive = archive
        self.tmp = tmp
        self.max_bytes = max_bytes
        self.budget = max_bytes
        self.entries = 0
        self.files: dict[str, tuple[int, str]] = {}
        self.dirs: set[str] = set()
        self.links: dict[str, str] = {}

    def admit(self, member: tarfile.TarInfo) -> str:
        """Check a member against the caps, the free space and the names so far; its clean name."""
        archive = self.archive
        self.entries += 1
        if self.entries > MAX_RESTORE_ENTRIES:
            raise ArchiveError(f"{archive}: more than {MAX_RESTORE_ENTRIES} entries")
        if member.size > self.budget:
            raise ArchiveError(
                f"{archive}: {member.name!r} ({member.size} bytes) would take the restore past "
                f"its cap of {self.max_bytes} bytes; nothing more written"
            )
        self.budget -= member.size
        if member.isfile() and member.size > _free_bytes(self.tmp):
            raise ArchiveError(
                f"{archive}: {member.name!r} needs {member.size} bytes, more than is free "
                f"on {self.tmp}"
            )
        name = _safe_member_name(member.name)
        if name in self.files or name in self.dirs or name in self.links:
            raise ArchiveError(f"{archive}: {name!r} appears twice")
        # Only this restore creates symlinks in tmp, so knowing them all is enough.
        prefixes = ["/".join(name.split("/")[:i]) for i in range(1, name.count("/") + 1)]
        if any(p in self.links for p in prefixes):
            raise ArchiveError(f"{archive}: {name!r} would be written through a symlink")
        return name

    def write(self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
        """Write one admitted member (not the manifest) into tmp."""
        if name.split("/")[0].startswith(RESTORE_MARKER):
            raise ArchiveError(
                f"{self.archive}: carries {name!r}, named like the host's restore marker; "
                "refusing it"
            )
        target_path = os.path.join(self.tmp, name)
        if member.isdir():
            os.makedirs(target_path, exist_ok=True)
            self.dirs.add(name)
        elif member.issym():
            if not _link_stays_inside(name, member.linkname):
                raise ArchiveError(
                    f"unsafe symlink in archive: {name!r} -> {member.linkname!r}; refusing it"
                )
            os.makedirs(os.path.dirname(target_path), exist_ok=True)
            os.symlink(member.linkname, target_path)
            self.links[name] = member.linkname
        elif member.isfile():
            os.makedirs(os.path.dirname(target_path), exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            self.files[name] = _write_new_file(src, target_path, member.mode)
        else:
            raise ArchiveError(
                f"{self.archive}: {name!r} is a device, fifo or hard link; refusing it"
            )

    def check_link_chains(self) -> None:
        for name, target in self.links.items():
            if not _resolves_inside(self.tmp, name):
                raise ArchiveError(
                    f"unsafe symlink in archive: {name!r} -> {target!r} resolves outside "
                    "the cache through a chain of links; refusing it"
                )


def _write_new_file(src: IO[bytes], path: str, mode: int) -> tuple[int, str]:
    """Copy src into a new file at path (never through a link); its (size, sha256)."""
    hasher = hashlib.sha256()
    size = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o755 if mode & 0o111 else 0o644)
    with os.fdopen(fd, "wb") as out:
        while chunk := src.read(COPY_BUFSIZE):
            hasher.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def _unpack(
    archive: str, tmp: str, max_bytes: int = MAX_RESTORE_BYTES
) -> tuple[dict[str, Any], bytes]:
    """Unpack into tmp, hashing each file; return (manifest, manifest bytes).

    Each member's size (from its tar header) is checked against `max_bytes` still left and the
    free space before a byte of it is written; every link chain must resolve inside tmp.
    """
    unpacker = _Unpacker(archive, tmp, max_bytes)
    manifest_body: bytes | None = None
    dctx = zstandard.ZstdDecompressor()
    with (
        open(archive, "rb") as raw,
        dctx.stream_reader(raw) as zst,
        tarfile.open(fileobj=zst, mode="r|") as tar,
    ):
        for member in tar:
            if manifest_body is not None:
                raise ArchiveError(f"{archive}: entries after the manifest; not a cache archive")
            name = unpacker.admit(member)
            if name != MANIFEST_NAME:
                unpacker.write(tar, member, name)
                continue
            if not member.isfile():
                raise ArchiveError(f"{archive}: manifest is not a regular file")
            fh = tar.extractfile(member)
            manifest_body = fh.read() if fh else b""
    unpacker.check_link_chains()
    manifest, body = _parse_manifest(archive, manifest_body)
    _check_against_manifest(archive, manifest, unpacker.files, unpacker.dirs, unpacker.links)
    return manifest, body


def _parse_manifest(archive: str, body: bytes | None) -> tuple[dict[str, Any], bytes]:
    if body is None:
        raise ArchiveError(f"{archive}: no manifest at the end: truncated or not a cache archive")
    try:
        manifest = json.loads(body)
    except ValueError as exc:
        raise ArchiveError(f"{archive}: manifest is not JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArchiveError(f"{archive}: manifest format is not {FORMAT}")
    problem = next(iter(_MANIFEST_VALIDATOR.iter_errors(manifest)), None)
    if problem is not None:
        where = "$" + "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in problem.absolute_path
        )
        raise ArchiveError(f"{archive}: manifest is malformed at {where}: {problem.message}")
    return manifest, body


# What _check_against_manifest reads of a manifest: anything else is refused with its place.
_MANIFEST_VALIDATOR = jsonschema.Draft202012Validator(
    {
        "type": "object",
        "required": ["format", "files"],
        "properties": {
            "files": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["path", "size", "sha256"],
                    "properties": {
                        "path": {"type": "string", "maxLength": 4096},
                        "size": {"type": "integer", "minimum": 0},
                        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                    },
                },
            },
            "dirs": {"type": "array", "items": {"type": "string", "maxLength": 4096}},
            "symlinks": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["path", "target"],
                    "properties": {
                        "path": {"type": "string", "maxLength": 4096},
                        "target": {"type": "string", "maxLength": 4096},
                    },
                },
            },
        },
    }
)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _check_against_manifest(
    archive: str,
    manifest: dict[str, Any],
    seen: dict[str, tuple[int, str]],
    seen_dirs: set[str],
    seen_links: dict[str, str],
) -> None:
    listed = {e["path"]: (int(e["size"]), e["sha256"]) for e in manifest.get("files", [])}
    for path, (size, digest) in listed.items():
        got = seen.get(path)
        if got is None:
            raise ArchiveError(f"{archive}: {path} is in the manifest but not in the archive")
        if got[0] != size:
            raise ArchiveError(f"{archive}: {path}: {got[0]} bytes, manifest says {size}")
        if got[1] != digest:
            raise ArchiveError(f"{archive}: {path}: sha256 {got[1]}, manifest says {digest}")
    extra = sorted(set(seen) - set(listed))
    if extra:
        raise ArchiveError(f"{archive}: {extra[0]} is in the archive but not in the manifest")
    links = {e["path"]: e["target"] for e in manifest.get("symlinks", [])}
    if links != seen_links or set(manifest.get("dirs", [])) != seen_dirs:
        raise ArchiveError(f"{archive}: directories or symlinks differ from the manifest")


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def restore_archive(  # noqa: PLR0913 - public call: archive, dest and four keyword options
    archive: str,
    dest: str,
    sha256: str | None = None,
    force: bool = False,
    full_key: str | None = None,
    max_bytes: int = MAX_RESTORE_BYTES,
) -> RestoreResult:
    """Restore an archive into `dest`, atomically and verified; a no-op if already restored.

    Nothing is written when the archive is over `max_bytes` or its digest is not `sha256`;
    while unpacking, each entry is checked against what is left of `max_bytes` first.

    >>> restore_archive("/srv/c0ffee.tar.zst", "/var/cache/hgxserve/3f2a")  # doctest: +SKIP
    """
    started = time.monotonic()
    dest = os.path.abspath(dest.rstrip("/"))
    if not os.path.isfile(archive):
        raise ArchiveError(f"{archive}: no such archive")
    want = expected_digest(archive, sha256)
    marker = read_marker(dest) if os.path.isdir(dest) else None
    if not force and marker and want and _marker_matches(marker, want, full_key):
        return RestoreResult(
            dest, want, marker.get("manifest_sha256", ""), int(marker.get("files", 0)),
            int(marker.get("bytes", 0)), changed=False, seconds=time.monotonic() - started,
        )  # fmt: skip
    _check_whole_archive(archive, dest, want, max_bytes)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.realpath(
        tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.restore-", dir=parent)
    )
    try:
        manifest, body = _unpack_for(archive, tmp, dest, max_bytes)
        os.chmod(tmp, 0o755)
        manifest_sha = hashlib.sha256(body).hexdigest()
        files = manifest.get("files", [])
        write_marker(
            tmp,
            {
                "format": FORMAT,
                "key": manifest.get("key"),
                "full_key": full_key,
                "archive_sha256": want or sha256_of(archive),
                "manifest_sha256": manifest_sha,
                "files": len(files),
                "bytes": int(manifest.get("total_bytes", 0)),
            },
        )
        replaced = os.path.lexists(dest)
        if replaced:
            _replace_dir(tmp, dest)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return RestoreResult(
        dest,
        want,
        manifest_sha,
        len(files),
        int(manifest.get("total_bytes", 0)),
        changed=True,
        seconds=time.monotonic() - started,
        replaced=replaced,
    )


def _marker_matches(marker: dict[str, Any], want: str, full_key: str | None) -> bool:
    """True when dest's restore marker says it already holds this archive (for this key)."""
    same_key = full_key is None or marker.get("full_key") == full_key
    return marker.get("archive_sha256") == want and same_key


def _check_whole_archive(archive: str, dest: str, want: str | None, max_bytes: int) -> None:
    """The archive's size against the cap and its sha256 against `want`, before any unpacking."""
    size = os.path.getsize(archive)
    if size > max_bytes:
        raise ArchiveError(
            f"{archive}: {size} bytes, over the restore cap of {max_bytes}; {dest} left untouched"
        )
    if want:
        got = sha256_of(archive)
        if got != want:
            raise ArchiveError(
                f"{archive}: sha256 is {got}, expected {want}: corrupt or truncated archive; "
                f"{dest} left untouched"
            )


def _unpack_for(archive: str, tmp: str, dest: str, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """_unpack, with every failure said as one that left `dest` untouched."""
    try:
        return _unpack(archive, tmp, max_bytes)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise ArchiveError(
            f"{archive}: corrupt or truncated archive ({exc}); {dest} left untouched"
        ) from exc
    except ArchiveError as exc:
        raise ArchiveError(f"{exc}; {dest} left untouched") from exc


def _replace_dir(tmp: str, dest: str) -> None:
    """Swap the unpacked tmp into dest's place and remove the previous cache."""
    old = tmp
    if not _exchange(tmp, dest):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.old-", dir=os.path.dirname(dest))
        os.rmdir(old)
        os.rename(dest, old)
        os.rename(tmp, dest)
    # old now holds the previous cache
    shutil.rmtree(old, ignore_errors=True)


def mark_packed(dest: str, result: PackResult, full_key: str | None = None) -> None:
    """Record on the bake host that `dest` holds exactly the archive it was packed into."""
    write_marker(
        dest,
        {
            "format": FORMAT,
            "key": os.path.basename(dest.rstrip("/")),
            "full_key": full_key,
            "archive_sha256": result.sha256,
            "manifest_sha256": result.manifest_sha256,
            "files": result.files,
            "bytes": result.bytes,
        },
    )


def cache_state(root: str) -> dict[str, Any]:
    """{render key: restore marker} for every key directory with a marker."""
    state: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(root, "*", ".hgxserve-cache.json"))):
        key = os.path.basename(os.path.dirname(path))
        marker = read_marker(os.path.dirname(path))
        if marker and valid_key(key):
            state[key] = marker
    return state
