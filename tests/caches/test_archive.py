"""Pack/restore: bit-exact round trip, deterministic bytes, corruption and traversal refused."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest
import zstandard

from hgxserve.base.cachelayout import BAKE_RECORD, RESTORE_MARKER
from hgxserve.caches import archive
from hgxserve.caches.archive import ArchiveError, pack_dir, restore_archive


def make_tree(root: str, seed: int = 0) -> None:
    """A cache-like tree: nested dirs, binary files, an empty dir, an executable, a symlink."""
    files = {
        "vllm/torch_compile_cache/abc/rank_0_0/backbone/model.py": b"def f(): pass\n" * 50,
        "vllm/modelinfos/llama.json": json.dumps({"seed": seed}).encode(),
        "triton/XYZ/kernel.cubin": os.urandom(200_000) if seed < 0 else bytes(range(256)) * 900,
        "inductor/fx/cache.bin": hashlib.sha256(str(seed).encode()).digest() * 4096,
        "deep_gemm/cache/kernel.so": b"\x7fELF" + bytes(5000),
        BAKE_RECORD: b'{"rounds": 1}\n',
    }
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    os.chmod(os.path.join(root, "deep_gemm/cache/kernel.so"), 0o755)
    os.makedirs(os.path.join(root, "nv"), exist_ok=True)
    os.makedirs(os.path.join(root, "tilelang"), exist_ok=True)
    os.symlink("XYZ/kernel.cubin", os.path.join(root, "triton/latest"))


def tree_digest(root: str) -> dict[str, str]:
    out = {}
    for top, dirs, names in os.walk(root):
        for name in dirs + names:
            full = os.path.join(top, name)
            rel = os.path.relpath(full, root)
            if rel == RESTORE_MARKER:
                continue
            if os.path.islink(full):
                out[rel] = "link:" + os.readlink(full)
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                with open(full, "rb") as fh:
                    mode = "x" if os.stat(full).st_mode & 0o111 else "-"
                    out[rel] = mode + hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture()
def tree(tmp_path):
    src = tmp_path / "root" / "key1"
    src.mkdir(parents=True)
    make_tree(str(src))
    return src


def test_round_trip_is_bit_exact(tree, tmp_path):
    result = pack_dir(str(tree), str(tmp_path / "out") + "/")
    assert os.path.basename(result.path) == f"{result.sha256}.tar.zst"
    assert result.files == 6
    dest = tmp_path / "host" / "key1"
    restored = restore_archive(result.path, str(dest))
    assert restored.changed and restored.files == 6
    assert tree_digest(str(dest)) == tree_digest(str(tree))
    marker = json.loads((dest / RESTORE_MARKER).read_text())
    assert marker["archive_sha256"] == result.sha256
    assert marker["manifest_sha256"] == result.manifest_sha256


def test_same_tree_gives_same_sha256(tree, tmp_path, monkeypatch):
    first = pack_dir(str(tree), str(tmp_path / "a") + "/")
    # a copy with other mtimes, another owner-independent mode and another zstd worker count
    copy = tmp_path / "copy" / "key1"
    copy.mkdir(parents=True)
    make_tree(str(copy))
    os.utime(copy / "vllm/modelinfos/llama.json", (1, 1))
    os.chmod(copy / "inductor/fx/cache.bin", 0o600)
    monkeypatch.setattr(archive, "ZSTD_THREADS", 1)
    second = pack_dir(str(copy), str(tmp_path / "b") + "/")
    assert first.sha256 == second.sha256
    with open(first.path, "rb") as a, open(second.path, "rb") as b:
        assert a.read() == b.read()


def test_content_change_changes_sha256(tree, tmp_path):
    first = pack_dir(str(tree), str(tmp_path / "a") + "/")
    (tree / "triton/XYZ/kernel.cubin").write_bytes(b"other")
    assert pack_dir(str(tree), str(tmp_path / "b") + "/").sha256 != first.sha256


def test_restore_marker_is_not_packed(tree, tmp_path):
    first = pack_dir(str(tree), str(tmp_path / "a") + "/")
    (tree / RESTORE_MARKER).write_text('{"archive_sha256": "x"}')
    assert pack_dir(str(tree), str(tmp_path / "b") + "/").sha256 == first.sha256


def test_restore_is_idempotent(tree, tmp_path):
    result = pack_dir(str(tree), str(tmp_path / "out") + "/")
    dest = tmp_path / "host" / "key1"
    assert restore_archive(result.path, str(dest)).changed
    inode = os.stat(dest).st_ino
    again = restore_archive(result.path, str(dest))
    assert not again.changed
    assert os.stat(dest).st_ino == inode


def test_restore_replaces_older_cache_atomically(tree, tmp_path):
    dest = tmp_path / "host" / "key1"
    dest.mkdir(parents=True)
    (dest / "stale.bin").write_bytes(b"old")
    result = pack_dir(str(tree), str(tmp_path / "out") + "/")
    restored = restore_archive(result.path, str(dest))
    assert restored.replaced
    assert not (dest / "stale.bin").exists()
    assert tree_digest(str(dest)) == tree_digest(str(tree))
    leftovers = [n for n in os.listdir(dest.parent) if n != "key1"]
    assert leftovers == []


def _old_cache(tmp_path):
    dest = tmp_path / "host" / "key1"
    dest.mkdir(parents=True)
    (dest / "kept.bin").write_bytes(b"previous cache")
    return dest


def _assert_untouched(dest):
    assert sorted(os.listdir(dest)) == ["kept.bin"]
    assert (dest / "kept.bin").read_bytes() == b"previous cache"
    assert sorted(os.listdir(dest.parent)) == ["key1"]


def test_truncated_archive_is_refused_and_old_dir_untouched(tree, tmp_path):
    result = pack_dir(str(tree), str(tmp_path / "out") + "/")
    data = open(result.path, "rb").read()  # noqa: SIM115
    cut = tmp_path / "cut.tar.zst"
    cut.write_bytes(data[: len(data) // 2])
    dest = _old_cache(tmp_path)
    _restore_refused(cut, dest, "truncated")


def test_corrupt_archive_named_by_digest_is_refused(tree, tmp_path):
    result = pack_dir(str(tree), str(tmp_path / "out") + "/")
    data = bytearray(open(result.path, "rb").read())  # noqa: SIM115
    data[len(data) // 2] ^= 0xFF
    with open(result.path, "wb") as fh:
        fh.write(data)
    dest = _old_cache(tmp_path)
    _restore_refused(result.path, dest, r"sha256 is .* expected .*corrupt")


def _write_archive(path, members, manifest=None):
    """Build an archive by hand (for hostile inputs)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        if manifest is not None:
            body = json.dumps(manifest).encode()
            info = tarfile.TarInfo(".hgxserve-manifest.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))


def _file(name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name, kind, target):
    """A symlink or hard link member for _write_archive."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def _restore_refused(archive_path, dest, match):
    """Restoring the archive fails with `match` and leaves the old cache at dest as it was."""
    with pytest.raises(ArchiveError, match=match):
        restore_archive(str(archive_path), str(dest))
    _assert_untouched(dest)


def _refused_archive(tmp_path, members, *manifest, match):
    """An archive of `members` (and `manifest`) that restoring over an old cache refuses with
    `match`, the old cache left as it was: (the archive, the old cache)."""
    bad = tmp_path / "bad.tar.zst"
    _write_archive(bad, members, *manifest)
    dest = _old_cache(tmp_path)
    _restore_refused(bad, dest, match)
    return bad, dest


def test_corrupt_file_inside_unnamed_archive_is_refused(tmp_path):
    manifest = {
        "format": archive.FORMAT,
        "files": [{"path": "a.bin", "size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}],
        "dirs": [],
        "symlinks": [],
    }
    _refused_archive(tmp_path, [_file("a.bin", b"abd")], manifest, match="a.bin: sha256")


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "/etc/evil", "./../evil"])
def test_path_traversal_is_refused(tmp_path, name):
    _refused_archive(tmp_path, [_file(name, b"x")], {"format": archive.FORMAT}, match="unsafe path")
    assert not (tmp_path / "evil").exists()


def test_symlink_escape_and_write_through_symlink_are_refused(tmp_path):
    link = _link("out", tarfile.SYMTYPE, "../../outside")
    bad, dest = _refused_archive(
        tmp_path, [link], {"format": archive.FORMAT}, match="unsafe symlink"
    )

    inner = _link("d", tarfile.SYMTYPE, "real")
    _write_archive(bad, [inner, _file("d/x", b"1")], {"format": archive.FORMAT})
    _restore_refused(bad, dest, "through a symlink")


def test_device_and_hardlink_members_are_refused(tmp_path):
    hard = _link("h", tarfile.LNKTYPE, "/etc/passwd")
    _refused_archive(tmp_path, [hard], {"format": archive.FORMAT}, match="hard link")


def test_archive_without_manifest_is_refused(tmp_path):
    _refused_archive(tmp_path, [_file("a", b"1")], match="no manifest")


def test_not_zstd_at_all_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(b"this is not an archive")
    dest = _old_cache(tmp_path)
    _restore_refused(bad, dest, "corrupt or truncated")


def test_pack_refuses_symlink_leaving_the_tree(tmp_path):
    src = tmp_path / "k"
    src.mkdir()
    os.symlink("/etc/passwd", src / "p")
    with pytest.raises(ArchiveError, match="outside"):
        pack_dir(str(src), str(tmp_path / "o") + "/")
