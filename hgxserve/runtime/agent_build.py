"""Controller side of the host agent: a wheelhouse of hgxserve and its pinned dependencies,
packed as one tarball named by its content, so hosts without internet can install it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HGXSERVE_CONTROLLER_CACHE", "/var/cache/hgxserve-controller"))
SOURCES = ("pyproject.toml", "hgxserve", "schemas", "files")


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


def _runtime_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


@cache
def wheelhouse() -> tuple[Path, str]:
    """(tarball, digest): dependency wheels cached per pyproject.toml, hgxserve's per source."""
    deps_dir = CACHE / "deps" / _digest([REPO / "pyproject.toml"])
    if not (deps_dir / ".complete").exists():
        requirements = deps_dir.with_suffix(".txt")
        requirements.parent.mkdir(parents=True, exist_ok=True)
        requirements.write_text("\n".join(_runtime_requirements()) + "\n")
        _pip_wheel(["-r", str(requirements)], deps_dir)
        for own in deps_dir.glob("hgxserve-*.whl"):
            own.unlink()
        (deps_dir / ".complete").touch()
    digest = _digest(source_files())
    tarball = CACHE / f"agent-{digest}.tar"
    if not tarball.exists():
        own_dir = CACHE / "own" / digest
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
            _pip_wheel(["--no-deps", str(src)], own_dir)
        pack_wheels([*deps_dir.glob("*.whl"), *own_dir.glob("*.whl")], tarball)
    return tarball, digest


def pack_wheels(wheels: list[Path], tarball: Path) -> None:
    """One flat, reproducible tar of `wheels` (sorted, no times or owners), written atomically
    and streamed, so a wheelhouse of several GB never sits in memory."""
    partial = tarball.with_suffix(".tmp")
    with tarfile.open(partial, mode="w") as tar:
        for wheel in sorted(wheels):
            info = tar.gettarinfo(str(wheel), arcname=wheel.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with wheel.open("rb") as fh:
                tar.addfile(info, fh)
    partial.replace(tarball)
