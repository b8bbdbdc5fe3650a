"""Local-directory sources: verify a read-only tree in place (the CephFS case, with the state dir
outside the tree) and stage it to local disk (`sync DIR DEST`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from weights_helpers import hgx, model_files, tree


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def test_manifest_publish_verify_in_place_and_stage(aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = model_files(7)
    ceph = tmp_path / "cephfs" / "models" / "tiny"
    _write_tree(ceph, files)
    built = hgx(aws_env, "manifest", str(ceph), "--publish")
    assert built.rc == 0, built.text
    manifest = json.loads((ceph / "hgxserve-manifest.json").read_text())
    digest = manifest["digest"]
    assert [f["path"] for f in manifest["files"]] == sorted(files)

    # In place: the mount is read-only, so state and marker live outside it.
    state_dir = tmp_path / "var-lib" / "tiny"
    os.chmod(ceph, 0o555)
    first = hgx(
        aws_env,
        "verify",
        str(ceph),
        "--state-dir",
        str(state_dir),
        "--digest",
        digest,
        "--json",
        "-q",
    )
    assert first.rc == 0, first.text
    assert json.loads(first.out)["hashed"] == len(files)
    second = hgx(aws_env, "verify", str(ceph), "--state-dir", str(state_dir), "--json", "-q")
    assert json.loads(second.out)["skipped"] == len(files)  # one stat per file, no hashing
    assert not (ceph / ".hgxserve").exists()
    ok = hgx(aws_env, "check-marker", str(ceph), "--state-dir", str(state_dir), "--digest", digest)
    assert ok.rc == 0, ok.text
    os.chmod(ceph, 0o755)

    # Staged: copy to local NVMe with inline hashing against the published manifest.
    nvme = tmp_path / "nvme" / "tiny"
    staged = hgx(aws_env, "sync", str(ceph), str(nvme), "--part-size", "1MiB", "--json", "-q")
    assert staged.rc == 0, staged.text
    report = json.loads(staged.out)
    assert report["manifest_digest"] == digest
    assert report["verified_by"] == {"manifest": len(files)}
    assert tree(nvme) == files
    noop = hgx(aws_env, "sync", str(ceph), str(nvme), "--json", "-q")
    assert json.loads(noop.out)["unchanged"] == len(files)


def test_stage_detects_source_that_differs_from_manifest(aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = model_files(8)
    src = tmp_path / "src"
    _write_tree(src, files)
    assert hgx(aws_env, "manifest", str(src), "--publish").rc == 0
    shard = src / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    run = hgx(aws_env, "sync", str(src), str(tmp_path / "dst"), "--part-size", "1MiB", "-q")
    assert run.rc == 1, run.text
    assert "model-00001-of-00002.safetensors: sha256" in run.err
    assert not (tmp_path / "dst" / "model-00001-of-00002.safetensors").exists()
    assert not (tmp_path / "dst" / ".hgxserve" / "verified").exists()


def test_verify_without_any_manifest_is_a_usage_error(aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = hgx(aws_env, "verify", str(tmp_path))
    assert run.rc == 2 and "no manifest" in run.err
