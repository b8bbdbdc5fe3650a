"""Controller side of venv runtimes: one wheelhouse per requirement set and host platform.

The controller downloads the engine, its pinned extras and every dependency once (`pip
download`, binary wheels for the hosts' Python and glibc, not the controller's), packs them as
one tarball named by its inputs, and the runtime role pushes that tarball to hosts that need
it; hosts install with `pip install --no-index` and never reach an index. A second run finds
the tarball in the cache and downloads nothing.

The tarball carries `requirements.lock`: every wheel in it pinned by version and sha256, so the
host installs with `--require-hashes --only-binary=:all:` exactly the files the controller
downloaded (transitive dependencies included) and nothing that would build from source.

    >>> tarball, key = build_wheelhouse(("vllm==0.26.0", "nixl==1.5.1"),
    ...     HostPlatform("3.11", "x86_64", "2.36"))   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hgxserve.base.compat import file_sha256

CACHE = Path(os.environ.get("HGXSERVE_CONTROLLER_CACHE", "/var/cache/hgxserve-controller"))
LOCK_NAME = "requirements.lock"  # in every runtime wheelhouse: the hash-pinned install set
LAYOUT = 2  # in the key: wheelhouses from before the lock are never reused


_PROCESS_LOCKS: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def cache_lock(name: str, cache: Path | None = None) -> Iterator[None]:
    """Hold the controller cache's lock on `name` (one wheelhouse, one download folder).

    Several deploys can run from one controller at once (two pyinfra runs, two labs, a tune's
    candidates): the first builds an entry while the others wait, then find it done; none
    reads or packs the other's half-downloaded files.
    """
    path = (cache or CACHE) / ".locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Within one process first: pyinfra runs each host in a gevent greenlet, and a second
    # greenlet blocking in flock(2) would stop the whole process, the holder included.
    with _PROCESS_LOCKS.setdefault(str(path), threading.Lock()), path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def hash_lock(requirements: tuple[str, ...] | list[str], wheels: list[Path]) -> str:
    """A pip requirements file pinning every wheel of a wheelhouse by version and sha256 (the
    requested pins keep their own text), for `pip install --require-hashes`.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); w = d / "six-1.17.0-py2.py3-none-any.whl"
    >>> _ = w.write_bytes(b"x"); hash_lock(["six==1.17.0"], [w])[:34]
    'six==1.17.0 --hash=sha256:2d711642'
    """
    found: dict[str, dict[str, list[str]]] = {}  # project -> version -> sha256s
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        with wheel.open("rb") as fh:
            digest = file_sha256(fh)
        found.setdefault(_canonical(name), {}).setdefault(version, []).append(digest)
    asked = {_canonical(re.split(r"[=<>!~\[; ]", r.strip(), maxsplit=1)[0]): r.strip()
             for r in requirements}  # fmt: skip
    missing = sorted(set(asked) - set(found))
    if missing:
        raise WheelhouseError(f"the wheelhouse holds no wheel for {', '.join(missing)}")
    lines = []
    for name in sorted(found):
        versions = found[name]
        if len(versions) > 1:
            raise WheelhouseError(
                f"the wheelhouse holds {name} at {', '.join(sorted(versions))}: one version only"
            )
        ((version, digests),) = versions.items()
        hashes = " ".join(f"--hash=sha256:{d}" for d in sorted(set(digests)))
        lines.append(f"{asked.get(name, f'{name}=={version}')} {hashes}")
    return "\n".join(lines) + "\n"


def pack_wheels(wheels: list[Path], tarball: Path) -> None:
    """One flat, reproducible tar of `wheels` (sorted, no times or owners), written atomically
    and streamed, so a wheelhouse of several GB never sits in memory."""
    partial = tarball.with_name(f".{tarball.name}.{os.getpid()}.tmp")
    with tarfile.open(partial, mode="w") as tar:
        for wheel in sorted(wheels, key=lambda path: path.name):
            info = tar.gettarinfo(str(wheel), arcname=wheel.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with wheel.open("rb") as fh:
                tar.addfile(info, fh)
    partial.replace(tarball)


class WheelhouseError(RuntimeError):
    """pip could not assemble the wheels (message carries pip's own last lines)."""


@dataclass(frozen=True)
class HostPlatform:
    """What decides which wheels fit a host: its python3 (major.minor), machine and glibc."""

    python: str
    machine: str
    glibc: str | None

    def pip_args(self) -> list[str]:
        """`pip download` arguments selecting wheels for this platform (not the controller's).

        pip takes `--platform` and `--abi` literally (it widens neither), so every tag a host
        accepts is listed: the stable ABI (`abi3`: vLLM's own wheels are `cp38-abi3`) and
        `none` beside the interpreter's, and every manylinux level from the host's glibc down
        (`manylinux_2_28` torch wheels on a glibc 2.36 host), with the legacy aliases.

        >>> HostPlatform("3.11", "x86_64", "2.36").pip_args()[:10]  # doctest: +NORMALIZE_WHITESPACE
        ['--only-binary=:all:', '--python-version', '3.11', '--implementation', 'cp',
         '--abi', 'cp311', '--abi', 'abi3', '--abi']
        >>> tags = HostPlatform("3.11", "x86_64", "2.36").platforms()
        >>> tags[:2], "manylinux_2_28_x86_64" in tags
        (['manylinux_2_36_x86_64', 'manylinux_2_35_x86_64'], True)
        >>> tags[-2:]
        ['manylinux1_x86_64', 'linux_x86_64']
        """
        args = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp"]
        for abi in ("cp" + self.python.replace(".", ""), "abi3", "none"):
            args += ["--abi", abi]
        for tag in self.platforms():
            args += ["--platform", tag]
        return args

    def tag(self) -> str:
        """A short name of the platform, for cache paths.

        >>> HostPlatform("3.10", "x86_64", "2.35").tag()
        'cp310-x86_64-glibc2.35'
        """
        return f"cp{self.python.replace('.', '')}-{self.machine}-glibc{self.glibc or 'unknown'}"

    def markers(self) -> dict[str, str]:
        """PEP 508 marker values of the host (pip evaluates markers for its own interpreter, even
        under `--python-version`: `async-timeout; python_version < "3.11"` is left out for a 3.10
        host by a 3.11 controller).

        >>> HostPlatform("3.10", "x86_64", "2.35").markers()["python_full_version"]
        '3.10.0'
        """
        full = f"{self.python}.0"
        return {
            "python_version": self.python,
            "python_full_version": full,
            "implementation_version": full,
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "platform_machine": self.machine,
            "platform_system": "Linux",
            "platform_release": "",
            "platform_version": "",
            "sys_platform": "linux",
            "os_name": "posix",
            "extra": "",
        }

    def platforms(self) -> list[str]:
        """Platform tags, most specific first, as pip would compute them on the host itself."""
        major, _, minor = (self.glibc or "2.17").partition(".")
        tags = []
        if major == "2" and minor.isdigit():
            for level in range(int(minor), 4, -1):
                tags.append(f"manylinux_2_{level}_{self.machine}")
                legacy = LEGACY_MANYLINUX.get((level, self.machine))
                if legacy:
                    tags.append(legacy)
        else:
            tags.append(f"manylinux2014_{self.machine}")
        return [*tags, f"linux_{self.machine}"]


# PEP 600's aliases for the manylinux levels that had names before it
LEGACY_MANYLINUX = {
    **{(17, m): f"manylinux2014_{m}" for m in ("x86_64", "i686", "aarch64", "ppc64le", "s390x")},
    **{(12, m): f"manylinux2010_{m}" for m in ("x86_64", "i686")},
    **{(5, m): f"manylinux1_{m}" for m in ("x86_64", "i686")},
}


@dataclass(frozen=True)
class IndexOptions:
    """Where the controller gets wheels: its own pip configuration unless told otherwise.

    + index_url: a package index or mirror (PEP 503 simple URL)
    + find_links: local directories (or URLs) of wheels to use as well
    + no_index: only find_links, never an index
    """

    index_url: str | None = None
    find_links: tuple[str, ...] = ()
    no_index: bool = False

    def pip_args(self) -> list[str]:
        args: list[str] = []
        if self.no_index:
            args.append("--no-index")
        elif self.index_url:
            args += ["--index-url", self.index_url]
        for link in self.find_links:
            args += ["--find-links", link]
        return args


def wheelhouse_key(
    requirements: tuple[str, ...], platform: HostPlatform, index: IndexOptions
) -> str:
    """Names a wheelhouse by everything that decides its content."""
    local = []
    for link in index.find_links:
        folder = Path(link)
        if folder.is_dir():  # a rebuilt wheel at the same version must give a new wheelhouse
            for wheel in sorted(folder.glob("*.whl")):
                stat = wheel.stat()
                local.append([wheel.name, stat.st_size, stat.st_mtime_ns])
    inputs = {
        "layout": LAYOUT,
        "requirements": sorted(requirements),
        "platform": [platform.python, platform.machine, platform.glibc],
        "index": [index.index_url, list(index.find_links), index.no_index, local],
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _requires(wheel: Path) -> list[str]:
    """The `Requires-Dist` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as whl:
        name = next((n for n in whl.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = whl.read(name).decode(errors="replace") if name else ""
    return [line[14:].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def missing_requirements(wheels: Path, platform: HostPlatform) -> list[str]:
    """Requirements of the wheels in `wheels` that hold on `platform` (its markers) and that no
    wheel there provides: what pip, evaluating markers for the controller, left out.

    >>> missing_requirements(Path("/nonexistent"), HostPlatform("3.10", "x86_64", "2.35"))
    []
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = sorted(wheels.glob("*.whl"))
    have = {canonicalize_name(w.name.split("-")[0]) for w in found}
    env = platform.markers()
    missing: set[str] = set()
    for wheel in found:
        for line in _requires(wheel):
            req = Requirement(line)
            if canonicalize_name(req.name) in have:
                continue
            if req.marker is None or req.marker.evaluate(env):
                req.marker = None
                missing.add(str(req))
    return sorted(missing)


def for_platform(requirements: list[str], platform: HostPlatform) -> list[str]:
    """The requirements whose markers hold on `platform`, markers dropped (pip would judge them
    by the controller's interpreter).

    >>> for_platform(["a==1", "b==2; python_version < '3.11'"], HostPlatform("3.10", "x86_64",
    ...     "2.35"))
    ['a==1', 'b==2']
    """
    from packaging.requirements import Requirement

    kept = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(platform.markers()):
            req.marker = None
            kept.append(str(req))
    return kept


def download_wheels(
    requirements: list[str], platform: HostPlatform, dest: Path, extra: list[str]
) -> None:
    """`pip download` `requirements` and their dependencies for `platform` into `dest`, then the
    dependencies that only the host's markers ask for (rounds until none is missing).

    + extra: more pip arguments (the index, `-r FILE`)
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
    cmd += ["--dest", str(dest), *platform.pip_args(), *extra]
    wanted = list(requirements)
    for _ in range(5):
        proc = subprocess.run([*cmd, *wanted], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
            raise WheelhouseError(f"pip download {' '.join(wanted or extra)} failed:\n{tail}")
        wanted = missing_requirements(dest, platform)
        if not wanted:
            return
    raise WheelhouseError(f"pip download: still missing for Python {platform.python}: {wanted}")


def build_wheelhouse(
    requirements: tuple[str, ...],
    platform: HostPlatform,
    index: IndexOptions | None = None,
    *,
    cache: Path | None = None,
    log: bool = True,
) -> tuple[Path, str]:
    """(tarball, key): the wheels for `requirements` on `platform`, downloaded once and cached."""
    index = index or IndexOptions()
    root = (cache or CACHE) / "runtime"
    key = wheelhouse_key(requirements, platform, index)
    tarball = root / f"runtime-{key}.tar"
    if tarball.exists():
        return tarball, key
    with cache_lock(f"runtime-{key}", cache):
        if not tarball.exists():
            _build_runtime(requirements, platform, index, tarball, log=log)
    return tarball, key


def _build_runtime(
    requirements: tuple[str, ...],
    platform: HostPlatform,
    index: IndexOptions,
    tarball: Path,
    *,
    log: bool,
) -> None:
    """Download into a fresh folder beside `tarball` (`<root>/<key>`: what a stopped download
    left is not trusted) and pack the tarball, under the caller's lock."""
    wheels = tarball.parent / tarball.stem.removeprefix("runtime-")
    shutil.rmtree(wheels, ignore_errors=True)
    started = time.monotonic()
    if log:
        print(f"runtime wheelhouse: downloading {' '.join(requirements)} for Python "
              f"{platform.python} {platform.machine}", file=sys.stderr, flush=True)  # fmt: skip
    download_wheels(list(requirements), platform, wheels, index.pip_args())
    files = sorted(p for p in wheels.iterdir() if p.suffix == ".whl")
    lock = wheels / LOCK_NAME
    lock.write_text(hash_lock(requirements, files))
    pack_wheels([*files, lock], tarball)
    if log:
        size = tarball.stat().st_size / 2**20
        print(f"runtime wheelhouse {wheels.name}: {len(files)} wheels, {size:.1f} MiB in "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)  # fmt: skip


def wheelhouse_lock_digest(tarball: Path) -> str:
    """`sha256:<hex>` of the wheelhouse's requirements.lock (kept in the venv's marker)."""
    with tarfile.open(tarball) as tar:
        fh = tar.extractfile(LOCK_NAME)
        if fh is None:
            raise WheelhouseError(f"{tarball}: no {LOCK_NAME}")
        return "sha256:" + hashlib.sha256(fh.read(64 << 20)).hexdigest()


_TORCH_CUDA = re.compile(rb"^cuda\s*(?::\s*\S+\s*)?=\s*['\"]([0-9.]+)['\"]", re.M)


def wheelhouse_torch(tarball: Path) -> tuple[str, str] | None:
    """(torch version, CUDA it was built for) of the torch wheel in a wheelhouse, read from the
    wheel's torch/version.py without unpacking it; None without torch (or a CPU build).

    The runtime stage checks this CUDA against the host's driver before pushing anything.
    """
    with tarfile.open(tarball) as tar:
        for member in tar:
            if not (member.name.startswith("torch-") and member.name.endswith(".whl")):
                continue
            fh = tar.extractfile(member)
            if fh is None:
                return None
            with zipfile.ZipFile(fh) as whl:  # the tar is uncompressed: the member seeks
                try:
                    text = whl.read("torch/version.py")
                except KeyError:
                    return None
            found = _TORCH_CUDA.search(text)
            version = member.name.split("-")[1]
            return (version, found.group(1).decode()) if found else None
    return None
