"""OCI image archives: the pinned manifest digest is proven before anything is loaded."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.cli.runtime import runtime
from hgxserve.runtime.images import ImageArchiveError, archive_name, image_digest, verify_archive


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def oci_archive(path: Path, *, tamper_layer: bool = False, docker: bool = False) -> str:
    """Write an OCI image layout tar (one layer) like `podman save --format oci-archive`."""
    layer_digest, layer = _blob(b"layer content " * 1000)
    config_digest, config = _blob(json.dumps({"architecture": "amd64", "os": "linux"}).encode())
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }).encode()  # fmt: skip
    manifest_digest, _ = _blob(manifest)
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json",
         "digest": manifest_digest, "size": len(manifest)}]}).encode()  # fmt: skip
    members = {
        "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
        "blobs/sha256/" + manifest_digest[7:]: manifest,
        "blobs/sha256/" + config_digest[7:]: config,
        "blobs/sha256/" + layer_digest[7:]: layer + (b"x" if tamper_layer else b""),
    }
    if docker:
        members = {"manifest.json": b"[]", "repositories": b"{}"}
    else:
        members["index.json"] = index
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return manifest_digest


def test_verified_archive(tmp_path: Path) -> None:
    digest = oci_archive(tmp_path / "a.tar")
    assert verify_archive(tmp_path / "a.tar", digest) == digest
    ok = CliRunner().invoke(runtime, ["verify-image", str(tmp_path / "a.tar"), digest])
    assert ok.exit_code == 0 and f"holds {digest}" in ok.output


def test_other_image_altered_layer_and_docker_archive_are_refused(tmp_path: Path) -> None:
    digest = oci_archive(tmp_path / "a.tar")
    other = "sha256:" + "e" * 64
    with pytest.raises(ImageArchiveError, match=f"holds manifest\\(s\\) {digest}, not {other}"):
        verify_archive(tmp_path / "a.tar", other)
    bad = oci_archive(tmp_path / "b.tar", tamper_layer=True)
    with pytest.raises(ImageArchiveError, match="blob sha256:.* is missing or altered"):
        verify_archive(tmp_path / "b.tar", bad)
    oci_archive(tmp_path / "c.tar", docker=True)
    with pytest.raises(ImageArchiveError, match="no index.json: not an OCI archive"):
        verify_archive(tmp_path / "c.tar", digest)
    (tmp_path / "d.tar").write_bytes(b"not a tar")
    with pytest.raises(ImageArchiveError, match="not a readable image archive"):
        verify_archive(tmp_path / "d.tar", digest)
    refused = CliRunner().invoke(runtime, ["verify-image", str(tmp_path / "b.tar"), bad])
    assert refused.exit_code == 1


def test_names() -> None:
    digest = "sha256:" + "ab" * 32
    assert image_digest(f"docker.io/vllm/vllm-openai@{digest}") == digest
    assert archive_name(digest) == "sha256-" + "ab" * 32 + ".oci.tar"
    with pytest.raises(ImageArchiveError, match="not pinned by digest"):
        image_digest("docker.io/vllm/vllm-openai:v0.26.0")


@pytest.mark.parametrize(
    "extra",
    ["blobs//sha256/{h}", "././blobs/sha256/{h}", "blobs/sha256/../sha256/{h}",
     "/blobs/sha256/{h}", "blobs/sha256/{h}", "./blobs/sha256/{h}"],
)  # fmt: skip
def test_a_second_copy_of_a_blob_under_any_spelling_is_refused(tmp_path: Path, extra: str) -> None:
    """An extractor normalises `blobs//sha256/x` and `././blobs/…` onto the checked name and
    keeps the later member: a tampered copy under another spelling must not pass."""
    digest = oci_archive(tmp_path / "a.tar")
    with tarfile.open(tmp_path / "a.tar") as tar:
        layer = next(m for m in tar.getmembers() if m.size > 10000)
    evil = b"evil layer"
    with tarfile.open(tmp_path / "a.tar", "a") as tar:
        info = tarfile.TarInfo(extra.format(h=layer.name.rsplit("/", 1)[1]))
        info.size = len(evil)
        tar.addfile(info, io.BytesIO(evil))
    with pytest.raises(ImageArchiveError, match="non-canonical name|appears twice"):
        verify_archive(tmp_path / "a.tar", digest)


def test_a_link_where_a_blob_belongs_is_refused(tmp_path: Path) -> None:
    digest = oci_archive(tmp_path / "a.tar")
    with tarfile.open(tmp_path / "a.tar", "a") as tar:
        info = tarfile.TarInfo("blobs/sha256/" + "f" * 64)
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/shadow"
        tar.addfile(info)
    with pytest.raises(ImageArchiveError, match="is a link or device"):
        verify_archive(tmp_path / "a.tar", digest)
