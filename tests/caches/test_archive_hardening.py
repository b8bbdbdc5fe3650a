"""Cache archives are untrusted: link chains, sizes over the cap, and the baker's own claim."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import zstandard
from pyinfra.api import OperationError

from hgxserve.caches import archive
from hgxserve.caches.archive import ArchiveError, restore_archive
from hgxserve.operations.caches import _fetch_baked, store_index


def _write(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], manifest: dict) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        body = json.dumps(manifest).encode()
        info = tarfile.TarInfo(".hgxserve-manifest.json")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


def _dir(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info, None


def _old(tmp_path: Path) -> Path:
    dest = tmp_path / "host" / "key1"
    dest.mkdir(parents=True)
    (dest / "kept.bin").write_bytes(b"previous cache")
    return dest


def test_relative_link_chain_escaping_the_cache_is_refused(tmp_path: Path) -> None:
    # each link alone stays inside ("x/y" -> "..": x/.. is the root; "z" -> "x/y/..": x),
    # but resolved together z is the parent of the cache
    members = [_dir("x"), _link("x/y", ".."), _link("z", "x/y/..")]
    manifest = {
        "format": archive.FORMAT,
        "files": [],
        "dirs": ["x"],
        "symlinks": [{"path": "x/y", "target": ".."}, {"path": "z", "target": "x/y/.."}],
    }
    bad = tmp_path / "chain.tar.zst"
    _write(bad, members, manifest)
    dest = _old(tmp_path)
    with pytest.raises(ArchiveError, match="chain of links"):
        restore_archive(str(bad), str(dest))
    assert sorted(os.listdir(dest)) == ["kept.bin"]


def test_a_member_over_the_cap_is_refused_before_it_is_written(tmp_path: Path) -> None:
    data = b"A" * 100_000
    info = tarfile.TarInfo("big.bin")
    info.size = len(data)
    manifest = {
        "format": archive.FORMAT,
        "files": [
            {"path": "big.bin", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        ],
        "dirs": [],
        "symlinks": [],
    }
    bad = tmp_path / "big.tar.zst"
    _write(bad, [(info, data)], manifest)
    dest = _old(tmp_path)
    with pytest.raises(ArchiveError, match="cap"):
        restore_archive(str(bad), str(dest), max_bytes=50_000 + os.path.getsize(bad))
    assert sorted(os.listdir(dest.parent)) == ["key1"]  # no restore dir left behind
    with pytest.raises(ArchiveError, match="over the restore cap"):
        restore_archive(str(bad), str(dest), max_bytes=10)
    restore_archive(str(bad), str(dest))
    assert (dest / "big.bin").read_bytes() == data


class _Host:
    """The two calls _fetch_baked makes, answered from a local directory (the baking host)."""

    name = "hgx-a"

    def __init__(self, marker: dict, archive_bytes: bytes, root: Path) -> None:
        self.marker, self.archive_bytes, self.root = marker, archive_bytes, root

    def run_shell_command(self, command: object) -> tuple[bool, SimpleNamespace]:
        return True, SimpleNamespace(stdout_lines=[json.dumps(self.marker)])

    def get_file(self, remote: str, local: str) -> bool:
        Path(local).write_bytes(self.archive_bytes)
        return True


def test_store_digest_is_the_controllers_own_hash(tmp_path: Path) -> None:
    body = b"archive bytes"
    real = hashlib.sha256(body).hexdigest()
    store = tmp_path / "store"
    honest = _Host({"archive_sha256": real}, body, tmp_path)
    _fetch_baked(None, honest, "k", "fk", "/var/cache/hgxserve", str(store))
    index = store_index(str(store), "fk")
    assert index is not None and index["sha256"] == real and index["hashed_by"] == "controller"
    lying = _Host({"archive_sha256": "0" * 64}, body, tmp_path)
    with pytest.raises(OperationError, match="hashes to"):
        _fetch_baked(None, lying, "k", "fk2", "/var/cache/hgxserve", str(store))
    assert store_index(str(store), "fk2") is None
    assert not (store / "fk2" / f"{'0' * 64}.tar.zst").exists()
    traversal = _Host({"archive_sha256": "../../etc/x"}, body, tmp_path)
    with pytest.raises(OperationError, match="names archive"):
        _fetch_baked(None, traversal, "k", "fk3", "/var/cache/hgxserve", str(store))


@pytest.mark.parametrize(
    ("files", "where"),
    [
        ([["a.bin", 1, "0" * 64]], r"\$\.files\[0\]"),
        ([{"path": "a.bin", "size": "1", "sha256": "0" * 64}], r"\$\.files\[0\]\.size"),
        ([{"path": "a.bin", "size": 1}], r"\$\.files\[0\]"),
        ([{"path": "a.bin", "size": 1, "sha256": "zz"}], r"\$\.files\[0\]\.sha256"),
        ({"a.bin": 1}, r"\$\.files"),
    ],
)
def test_a_malformed_manifest_is_a_clear_error(tmp_path: Path, files: object, where: str) -> None:
    """A manifest of the right format with entries of the wrong shape: an ArchiveError naming
    the place, never a KeyError or TypeError traceback; the old cache stays."""
    info = tarfile.TarInfo("a.bin")
    info.size = 1
    bad = tmp_path / "bad.tar.zst"
    _write(bad, [(info, b"a")], {"format": archive.FORMAT, "files": files})
    dest = _old(tmp_path)
    with pytest.raises(ArchiveError, match=f"manifest is malformed at {where}"):
        restore_archive(str(bad), str(dest))
    assert sorted(os.listdir(dest)) == ["kept.bin"]


def test_an_entry_named_like_the_marker_or_its_temporary_is_refused(tmp_path: Path) -> None:
    """A directory `.hgxserve-cache.json.tmp` in an archive once made the marker's write a
    traceback; names starting like the marker are refused, and the marker is written through
    a fresh temporary."""
    marker = archive.RESTORE_MARKER
    for name in (marker, marker + ".tmp", marker + ".x/y"):
        bad = tmp_path / "marker.tar.zst"
        top = name.split("/")[0]
        members = [_dir(top)] if "/" in name or name.endswith(".tmp") else []
        if not members:
            info = tarfile.TarInfo(name)
            info.size = 2
            members = [(info, b"{}")]
        _write(bad, members, {"format": archive.FORMAT, "files": [], "dirs": [top]})
        with pytest.raises(ArchiveError, match="named like the host's restore marker"):
            restore_archive(str(bad), str(_old(tmp_path / name.replace("/", "_"))))
    dest = tmp_path / "plain"
    dest.mkdir()
    (dest / (marker + ".tmp")).mkdir()  # left there by anything: the write does not care
    archive.write_marker(str(dest), {"archive_sha256": "a" * 64})
    assert json.loads((dest / marker).read_text()) == {"archive_sha256": "a" * 64}
