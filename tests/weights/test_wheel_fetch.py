"""`hgxserve runtime fetch-wheel`: a `runtime.wheels` url from the weights' S3 (real moto
server), kept only when it has the pinned sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from weights_helpers import Bucket

from hgxserve.cli.runtime import runtime

WHEEL = "deep_ep-1.2.1-cp312-cp312-linux_x86_64.whl"


def test_fetch_check_and_refuse(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in aws_env.items():
        monkeypatch.setenv(key, value)
    body = b"a wheel's bytes"
    sha = hashlib.sha256(body).hexdigest()
    bucket.put(f"wheels/{WHEEL}", body)
    url = f"s3://{bucket.name}/wheels/{WHEEL}"
    out = tmp_path / "staging" / WHEEL
    args = ["--out", str(out), "--endpoint-url", f"http://127.0.0.1:{bucket.port}"]
    args += ["--addressing", "path"]
    runner = CliRunner()
    got = runner.invoke(runtime, ["fetch-wheel", url, sha, *args])
    assert got.exit_code == 0, got.output
    assert out.read_bytes() == body
    again = runner.invoke(runtime, ["fetch-wheel", url, sha, *args])
    assert again.exit_code == 0 and f"{out}: already holds sha256 {sha}" in again.output
    out.unlink()
    refused = runner.invoke(runtime, ["fetch-wheel", url, "e" * 64, *args])
    assert refused.exit_code == 1
    assert f"sha256 {sha}, the topology pins {'e' * 64}" in refused.output
    assert not out.exists()
