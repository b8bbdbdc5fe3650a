"""Credentials: SigV4 accepted by a server that checks signatures, rejected keys give a clear
error without the secret, env-file references are read (0600 only) and never printed."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from weights_helpers import SECRET_KEY, Run, hgx, start_moto, stop_process, tree


@pytest.fixture(scope="module")
def auth_moto() -> Iterator[tuple[int, str, str, str]]:
    """A moto server that authenticates every request against its IAM users."""
    proc, port = start_moto()
    try:
        url = f"http://127.0.0.1:{port}"
        boot = {
            "aws_access_key_id": "bootstrap",
            "aws_secret_access_key": "bootstrap",
            "region_name": "us-east-1",
            "endpoint_url": url,
        }
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="reader")
        iam.put_user_policy(
            UserName="reader",
            PolicyName="s3",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        s3 = boto3.client("s3", **boot)
        s3.create_bucket(Bucket="secured")
        s3.put_object(Bucket="secured", Key="m/a.bin", Body=b"A" * 1_500_000)
        s3.put_object(Bucket="secured", Key="m/dir/b.json", Body=b'{"b": 1}')
        req = urllib.request.Request(
            f"{url}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(req, timeout=5).read()
        yield port, key["AccessKeyId"], key["SecretAccessKey"], url
    finally:
        stop_process(proc)


def _env(aws_env: dict[str, str], **values: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in aws_env.items()
        if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")
    }
    env.update(values)
    return env


def _sync_m(env: dict[str, str], tmp_path: Path, *args: str) -> Run:
    """`weights sync s3://secured/m/ TMP/m ARGS...` with this environment."""
    return hgx(env, "sync", "s3://secured/m/", str(tmp_path / "m"), *args)


def test_valid_signature_accepted(auth_moto, aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port, access, secret, url = auth_moto
    env = _env(aws_env, AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret)
    run = _sync_m(
        env,
        tmp_path,
        "--endpoint-url",
        url,
        "--part-size",
        "1MiB",
        "-q",
        "--allow-size-etag",
        "--allow-incomplete",
    )
    assert run.rc == 0, run.text
    assert tree(tmp_path / "m") == {"a.bin": b"A" * 1_500_000, "dir/b.json": b'{"b": 1}'}
    assert secret not in run.text


def test_wrong_secret_clear_error_without_secret(auth_moto, aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port, access, _secret, url = auth_moto
    env = _env(aws_env, AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    run = _sync_m(env, tmp_path, "--endpoint-url", url, "-q")
    assert run.rc == 4, run.text
    assert "SignatureDoesNotMatch" in run.err and "hint:" in run.err
    assert SECRET_KEY not in run.text and "Traceback" not in run.text
    assert not (tmp_path / "m" / ".hgxserve" / "verified").exists()


def test_unknown_key_clear_error(auth_moto, aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _port, _access, _secret, url = auth_moto
    env = _env(aws_env, AWS_ACCESS_KEY_ID="AKIDNOTAUSER00000000", AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    run = _sync_m(env, tmp_path, "--endpoint-url", url, "-q")
    assert run.rc == 4, run.text
    assert "InvalidAccessKeyId" in run.err and SECRET_KEY not in run.text


def test_env_file_reference(auth_moto, aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _port, access, secret, url = auth_moto
    env_file = tmp_path / "s3.env"
    env_file.write_text(
        f"# model store, read-only\nAWS_ACCESS_KEY_ID={access}\n"
        f"AWS_SECRET_ACCESS_KEY='{secret}'\nAWS_ENDPOINT_URL={url}\n"
    )
    os.chmod(env_file, 0o644)
    env = _env(aws_env)
    loose = _sync_m(env, tmp_path, "--env-file", str(env_file))
    assert loose.rc == 4 and "chmod 600" in loose.err
    os.chmod(env_file, 0o600)
    run = _sync_m(
        env,
        tmp_path,
        "--env-file",
        str(env_file),
        "-q",
        "--allow-size-etag",
        "--allow-incomplete",
    )
    assert run.rc == 0, run.text
    assert secret not in run.text
    state = (tmp_path / "m" / ".hgxserve" / "state.json").read_text()
    assert secret not in state and access not in state


def test_no_credentials_at_all(aws_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = _env(aws_env)
    run = _sync_m(env, tmp_path, "--endpoint-url", "http://127.0.0.1:9", "-q")
    assert run.rc == 4, run.text
    assert "no AWS credentials found" in run.err
