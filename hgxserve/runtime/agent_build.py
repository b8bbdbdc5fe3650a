"""Controller side of the host agent: a wheelhouse of hgxserve and its pinned dependencies,
packed as one tarball named by its content, so hosts without internet can install it.

The wheels are the host's, not the controller's: the dependencies are downloaded for the
Python, machine and glibc the host's facts report (`pip download --only-binary=:all:`, as the
runtime wheelhouse does), once per pyproject and platform; hgxserve's own wheel (pure Python) is
built once per source and goes into every platform's tarball. The agent runs on the host's own
python3, 3.10 through 3.13 (`AGENT_PYTHONS`).

    >>> tarball, key = wheelhouse(HostPlatform("3.10", "x86_64", "2.35"))  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from hgxserve.runtime.wheelhouse import (
    CACHE,
    LAYOUT,
    LOCK_NAME,
    HostPlatform,
    cache_lock,
    download_wheels,
    for_platform,
    hash_lock,
    pack_wheels,
)

OWN_LOCK = "hgxserve.lock"  # hgxserve's own line of the lock: reinstalled on every update

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "hgxserve", "schemas", "files")
# The host Pythons the agent runs on (pyproject's requires-python; vermin checks the code).
AGENT_PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def python_problem(version: str | None) -> str | None:
    """Why a host's python3 cannot run the agent (None when it can), as a preflight line's tail.

    >>> python_problem("3.12.3") is None, python_problem("3.9")
    (True, 'expected Python 3.10 to 3.13 for the hgxserve agent, found Python 3.9')
    """
    if version and ".".join(version.split(".")[:2]) in AGENT_PYTHONS:
        return None
    found = f"Python {version}" if version else "no python3"
    supported = f"{AGENT_PYTHONS[0]} to {AGENT_PYTHONS[-1]}"
    return f"expected Python {supported} for the hgxserve agent, found {found}"


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def source_files() -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        root = REPO / name
        if root.is_file():
            files.append(root)
            continue
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path)
    return files


def _pip_wheel(args: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w"]
    proc = subprocess.run([*cmd, str(dest), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building wheels failed:\n{proc.stderr[-2000:]}")


__all__ = ["CACHE", "AGENT_PYTHONS", "pack_wheels", "python_problem", "wheelhouse"]


def _runtime_requirements() -> list[str]:
    if sys.version_info >= (3, 11):
        import tomllib  # novermin (3.11 and later)
    else:  # a 3.10 controller: pip (which builds the wheelhouse) vendors tomli
        from pip._vendor import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def controller_platform() -> HostPlatform:
    """The controller's own interpreter and platform (what `wheelhouse()` builds for by default)."""
    import platform

    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return HostPlatform(python, platform.machine(), platform.libc_ver()[1] or None)


def _deps(platform: HostPlatform) -> Path:
    """The folder of dependency wheels for `platform`, downloaded once per pyproject.toml."""
    digest = _digest([REPO / "pyproject.toml"])
    deps_dir = CACHE / "deps" / digest / platform.tag()
    if (deps_dir / ".complete").exists():
        return deps_dir
    with cache_lock(f"agent-deps-{digest}-{platform.tag()}"):
        if not (deps_dir / ".complete").exists():
            shutil.rmtree(deps_dir, ignore_errors=True)  # a stopped download is not trusted
            requirements = for_platform(_runtime_requirements(), platform)
            download_wheels(requirements, platform, deps_dir, [])
            for own in deps_dir.glob("hgxserve-*.whl"):
                own.unlink()
            (deps_dir / ".complete").touch()
    return deps_dir


@cache
def wheelhouse(platform: HostPlatform | None = None) -> tuple[Path, str]:
    """(tarball, key) of the agent for `platform` (the controller's own when None): dependency
    wheels cached per pyproject.toml and platform, hgxserve's own per source; the key names
    both (`<source digest>-<platform tag>`)."""
    platform = platform or controller_platform()
    deps_dir = _deps(platform)
    digest = _digest(source_files())
    key = f"{digest}-{platform.tag()}"
    tarball = CACHE / f"agent-{key}.l{LAYOUT}.tar"
    if tarball.exists():
        return tarball, key
    with cache_lock(f"agent-{key}"):
        if not tarball.exists():
            _pack_agent(deps_dir, digest, key, tarball)
    return tarball, key


def _pack_agent(deps_dir: Path, digest: str, key: str, tarball: Path) -> None:
    """The agent's tarball: the dependency wheels, hgxserve's own and their hash locks."""
    wheels = [*deps_dir.glob("*.whl"), *_own_wheel(digest)]
    locks = CACHE / "locks" / key
    locks.mkdir(parents=True, exist_ok=True)
    lock = hash_lock([], wheels)
    (locks / LOCK_NAME).write_text(lock)
    own = [line for line in lock.splitlines() if line.startswith("hgxserve==")]
    (locks / OWN_LOCK).write_text("\n".join(own) + "\n")
    pack_wheels([*wheels, locks / LOCK_NAME, locks / OWN_LOCK], tarball)


def _own_wheel(digest: str) -> list[Path]:
    """hgxserve's own wheel for the current sources, built once (pure Python: every platform)."""
    own_dir = CACHE / "own" / digest
    built = sorted(own_dir.glob("hgxserve-*.whl"))
    if not built:
        with tempfile.TemporaryDirectory(prefix="hgxserve-wheel-") as tmp:
            # build from a copy: setuptools' in-tree build/ dir is not safe to share
            src = Path(tmp) / "src"
            src.mkdir()
            for name in (*SOURCES, "README.md"):
                path = REPO / name
                if path.is_dir():
                    shutil.copytree(
                        path,
                        src / name,
                        symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__"),
                    )
                elif path.exists():
                    shutil.copy2(path, src / name)
            _pip_wheel(["--no-deps", str(src)], Path(tmp) / "out")
            # moved in whole: another deploy building the same sources never sees half a wheel
            own_dir.mkdir(parents=True, exist_ok=True)
            for wheel in (Path(tmp) / "out").glob("hgxserve-*.whl"):
                os.replace(wheel, own_dir / wheel.name)
        built = sorted(own_dir.glob("hgxserve-*.whl"))
    return built
