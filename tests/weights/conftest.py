"""Fixtures: a real moto S3 server on 127.0.0.1 (ephemeral port, stopped by PID), a counting /
fault-injecting proxy in front of it, and AWS settings that point only at them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from weights_helpers import Bucket, aws_env_for, boto_client, start_moto, stop_process
from weights_s3proxy import ProxyState, start_proxy


@pytest.fixture(scope="session")
def moto() -> Iterator[int]:
    proc, port = start_moto()
    yield port
    stop_process(proc)


@pytest.fixture(scope="session")
def proxy_pair(moto: int) -> Iterator[tuple[int, ProxyState]]:
    server, state = start_proxy(("127.0.0.1", moto))
    yield server.server_address[1], state
    server.shutdown()


@pytest.fixture()
def proxy(proxy_pair: tuple[int, ProxyState]) -> tuple[int, ProxyState]:
    proxy_pair[1].reset()
    return proxy_pair


@pytest.fixture()
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    return aws_env_for(monkeypatch, tmp_path)


@pytest.fixture()
def bucket(moto: int, aws_env: dict[str, str]) -> Bucket:
    name = "m-" + uuid.uuid4().hex[:12]
    boto_client(moto).create_bucket(Bucket=name)
    return Bucket(name, moto)
