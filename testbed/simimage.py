"""SIMULATED engine container image for the test hosts: an OCI archive built on the controller.

The container runtime role (roles/container_runtime.py) loads engine images by digest from an
OCI archive in the weights' S3. On the test hosts it loads this one: a single-layer image made
from the test hosts' own root filesystem (Debian's python3, the shared libraries it and its
extension modules link, the standard library without tests/IDLE/Tk, /bin/sh with ls, tr and
grep) plus the simulated engine
(testbed/simengine.py, packaged as in testbed/simwheels.py) and a `vllm` / `sglang` command that
runs it. Nothing is downloaded. It is marked as simulated in its tag (`*-sim`), its config
labels and its code.

The archive is deterministic (sorted members, mtime 0, root-owned), so the same root
filesystem and simengine always give the same manifest digest.

    python -m testbed.simimage /var/lib/hgxserve-testbed/rootfs/<stamp> /tmp/sim.oci.tar
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from testbed import simwheels

REPO_NAME = "localhost/hgxserve-sim/vllm"  # localhost/: no registry holds it
TAG = "0.26.0-sim"
PYTHON = "usr/bin/python3.11"
STDLIB = "usr/lib/python3.11"
# a shell and what preflight's in-image check runs with it (hgxserve.runtime.image_check), as
# an engine image (Ubuntu-based) has them
SHELL = ("usr/bin/dash", "usr/bin/ls", "usr/bin/tr", "usr/bin/grep")
# parts of the standard library an engine never imports (and that make up most of its size)
PRUNE = (
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
    "config-3.11-x86_64-linux-gnu", "__pycache__", "sitecustomize.py", "unittest",
)  # fmt: skip
COMMAND = """#!/usr/bin/python3
# SIMULATED {engine}: hgxserve test equipment, not the real engine (runs simulated_engine.py).
import sys

from {engine} import main

sys.exit(main())
"""


class ImageBuildError(RuntimeError):
    """The root filesystem lacks what the image needs."""


def _needed_libraries(rootfs: Path, binaries: list[str]) -> set[str]:
    """Paths (inside `rootfs`) of the shared libraries `binaries` load, by the tree's own ldd."""
    proc = subprocess.run(
        ["chroot", str(rootfs), "ldd", *("/" + b for b in binaries)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = set()
    for line in proc.stdout.splitlines():
        words = line.split()
        if not words or line.rstrip().endswith(":"):
            continue  # "/usr/bin/python3.11:": the header ldd prints per file
        if "=>" in words and len(words) > words.index("=>") + 1:
            path = words[words.index("=>") + 1]
            if path.startswith("/"):
                found.add(path.lstrip("/"))
        elif words[0].startswith("/"):
            found.add(words[0].lstrip("/"))  # the dynamic loader
    if not found:
        raise ImageBuildError(f"ldd found no libraries in {rootfs}: {proc.stderr.strip()}")
    return found


class _Layer:
    """A tar layer built member by member: parent directories and symlink chains included."""

    def __init__(self, rootfs: Path) -> None:
        self.rootfs = rootfs
        self.members: dict[str, tuple[tarfile.TarInfo, bytes | None]] = {}

    def _info(self, name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = kind, mode, 0
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    def directory(self, name: str, mode: int = 0o755) -> None:
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in self.members:
                self.members[sub] = (self._info(sub, tarfile.DIRTYPE, mode), None)

    def data(self, name: str, body: bytes, mode: int = 0o644) -> None:
        self.directory(os.path.dirname(name)) if "/" in name else None
        info = self._info(name, tarfile.REGTYPE, mode)
        info.size = len(body)
        self.members[name] = (info, body)

    def copy(self, name: str) -> None:
        """Add `name` from the root filesystem, following (and keeping) symlinks on its way."""
        parts = name.strip("/").split("/")
        done: list[str] = []
        while parts:
            part = parts.pop(0)
            rel = "/".join([*done, part])
            path = self.rootfs / rel
            if path.is_symlink():
                target = os.readlink(path)
                info = self._info(rel, tarfile.SYMTYPE, 0o777)
                info.linkname = target
                if done:
                    self.directory("/".join(done))
                self.members[rel] = (info, None)
                base = [] if target.startswith("/") else done
                resolved = os.path.normpath("/".join([*base, target.lstrip("/")]))
                parts = [*resolved.split("/"), *parts]
                done = []
                continue
            if parts:
                done.append(part)
                continue
            if path.is_dir():
                self.directory(rel)
            elif path.is_file():
                self.data(rel, path.read_bytes(), path.stat().st_mode & 0o777)
            else:
                raise ImageBuildError(f"{path}: missing from the root filesystem")

    def tree(self, name: str) -> None:
        top = self.rootfs / name
        for path in sorted(top.rglob("*")):
            rel = path.relative_to(self.rootfs).as_posix()
            if set(path.relative_to(top).parts) & set(PRUNE):
                continue
            if path.is_symlink() or path.is_file():
                self.copy(rel)
            elif path.is_dir():
                self.directory(rel)

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(self.members):
                info, body = self.members[name]
                tar.addfile(info, io.BytesIO(body) if body is not None else None)
        return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def build_image(rootfs: Path, out: Path, engine: str = "vllm") -> str:
    """Write the simulated `engine` image as an OCI archive at `out`; return its manifest digest.

    Example: ``build_image(Path("/var/lib/hgxserve-testbed/rootfs/94e1b6"), Path("sim.tar"))``
    -> ``"sha256:..."``
    """
    if not (rootfs / PYTHON).is_file():
        raise ImageBuildError(f"{rootfs}: no {PYTHON} (not the test hosts' root filesystem)")
    layer = _Layer(rootfs)
    dynload = sorted(
        p.relative_to(rootfs).as_posix() for p in (rootfs / STDLIB / "lib-dynload").glob("*.so")
    )
    for lib in sorted(_needed_libraries(rootfs, [PYTHON, *SHELL, *dynload])):
        layer.copy(lib)
    layer.copy("usr/bin/python3")
    for name in ("bin/sh", *SHELL):
        layer.copy(name)
    layer.tree(STDLIB)
    for name in ("etc", "tmp", "var/tmp", "run", "proc", "sys", "dev", "root"):
        layer.directory(name, 0o1777 if name.endswith("tmp") else 0o755)
    version = simwheels.ENGINES[engine]
    package = f"usr/lib/python3/dist-packages/{engine}"
    init = simwheels.ENGINE_INIT.format(engine=engine, version=version)
    layer.data(f"{package}/__init__.py", init.encode())
    layer.data(f"{package}/simulated_engine.py", simwheels.SIMENGINE.read_bytes())
    layer.data(f"usr/local/bin/{engine}", COMMAND.format(engine=engine).encode(), 0o755)

    raw = layer.tar()
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    layer_digest, layer_gz = _blob(gzip.compress(raw, compresslevel=6, mtime=0))
    description = f"SIMULATED {engine} {version} for hgxserve test hosts: not the real engine"
    labels = {"org.hgxserve.simulated": "true", "org.opencontainers.image.description": description}
    config_digest, config = _blob(json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": [f"/usr/local/bin/{engine}"], "Labels": labels,
                   "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }, sort_keys=True).encode())  # fmt: skip
    manifest_digest, manifest = _blob(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": len(layer_gz)}],
    }, sort_keys=True).encode())  # fmt: skip
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": manifest_digest, "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": f"{REPO_NAME}:{TAG}"},
    }]}, sort_keys=True).encode()  # fmt: skip
    archive = _Layer(rootfs)
    archive.data("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
    archive.data("index.json", index)
    for digest, body in ((manifest_digest, manifest), (config_digest, config),
                         (layer_digest, layer_gz)):  # fmt: skip
        archive.data("blobs/sha256/" + digest[7:], body)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_bytes(archive.tar())
    partial.replace(out)
    return manifest_digest


def cached_image(rootfs: Path, cache: Path, engine: str = "vllm") -> tuple[Path, str]:
    """(archive, manifest digest) of the image for this root filesystem and simengine, built once.

    The root filesystem's directory is named by its recipe stamp (testbed/rootfs.py), so the key
    is that name, the simengine's and this module's bytes, and the engine.
    """
    inputs = hashlib.sha256()
    for part in (rootfs.name.encode(), engine.encode(), simwheels.SIMENGINE.read_bytes(),
                 Path(__file__).read_bytes()):  # fmt: skip
        inputs.update(hashlib.sha256(part).digest())
    archive = cache / f"sim-{engine}-{inputs.hexdigest()[:16]}.oci.tar"
    stamp = archive.with_name(archive.name + ".digest")
    if archive.is_file() and stamp.is_file():
        return archive, stamp.read_text().strip()
    digest = build_image(rootfs, archive, engine)
    stamp.write_text(digest + "\n")
    return archive, digest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m testbed.simimage ROOTFS OUT.tar")
    print(build_image(Path(sys.argv[1]), Path(sys.argv[2])))
