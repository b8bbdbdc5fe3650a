"""`hgxserve runtime fetch-image`: an engine image's OCI archive from the weights' S3 (real moto
server), kept only when it holds the pinned manifest digest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from weights_helpers import VENV_BIN, Bucket

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_image_archive import oci_archive  # noqa: E402


def fetch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "hgxserve"), "runtime", "fetch-image", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_fetch_verify_and_refuse(bucket: Bucket, aws_env: dict[str, str], tmp_path: Path) -> None:
    digest = oci_archive(tmp_path / "image.tar")
    key = "images/" + digest.replace(":", "-") + ".oci.tar"
    bucket.put(key, (tmp_path / "image.tar").read_bytes())
    endpoint = f"http://127.0.0.1:{bucket.port}"
    out = tmp_path / "host" / "image.oci.tar"
    url = f"s3://{bucket.name}/{key}"
    args = ["--out", str(out), "--endpoint-url", endpoint, "--addressing", "path"]
    got = fetch(aws_env, url, digest, *args)
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == (tmp_path / "image.tar").read_bytes()
    again = fetch(aws_env, url, digest, *args)
    assert again.returncode == 0 and f"{out}: already holds {digest}" in again.stdout
    # an archive that is not the pinned image is not kept
    out.unlink()
    other = "sha256:" + "e" * 64
    refused = fetch(aws_env, url, other, *args)
    assert refused.returncode == 1 and f"not {other}" in refused.stderr
    assert not out.exists()
    missing = fetch(aws_env, f"s3://{bucket.name}/images/none.tar", digest, *args)
    assert missing.returncode == 1 and "no such object" in missing.stderr
