"""Helpers for the weights tests: moto start/stop, S3 upload, the CLI runner, model trees."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weights_s3proxy import ProxyState

VENV_BIN = Path(sys.executable).parent
ACCESS_KEY = "AKIDHGXSERVETEST0001"
SECRET_KEY = "hgxTESTsecretDoNotPrint/9f8e7d6c5b4a3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.Popen(
        [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def aws_env_for(monkeypatch, tmp_path: Path) -> dict[str, str]:  # type: ignore[no-untyped-def]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AWS_") and k.lower() not in ("http_proxy", "https_proxy", "no_proxy")
    }
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    return env


def boto_client(port: int):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )


@dataclass
class Bucket:
    name: str
    port: int

    def put(self, key: str, data: bytes, **kwargs: object) -> None:
        boto_client(self.port).put_object(Bucket=self.name, Key=key, Body=data, **kwargs)


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def hgx(env: dict[str, str], *args: str, timeout: float = 60) -> Run:
    proc = subprocess.run(
        [str(VENV_BIN / "hgxserve"), "weights", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True)
class Fault:
    """A fault the S3 proxy sends `count` times (`knob` on its faults, `sent` its counter of
    them), and the words a sync that goes through it must say."""

    knob: str
    count: int
    sent: str
    said: tuple[str, ...] = ()


def sync_through(fault: Fault, proxy: tuple[int, ProxyState], sync: Callable[[int], Run]) -> Run:
    """`sync(port)` through the fault proxy sending `fault`: it succeeds, every fault was sent,
    and the run says what `fault.said` says."""
    port, seen = proxy
    setattr(seen.faults, fault.knob, fault.count)
    run = sync(port)
    assert run.rc == 0, run.text
    assert getattr(seen, fault.sent) == fault.count
    for words in fault.said:
        assert words in run.err
    return run


def model_files(seed: int = 1) -> dict[str, bytes]:
    """A small model tree: two multi-part shards, small files, a nested file, an empty file."""
    import random

    rng = random.Random(seed)
    return {
        "model-00001-of-00002.safetensors": rng.randbytes(3 * 1024 * 1024 + 123),
        "model-00002-of-00002.safetensors": rng.randbytes(2 * 1024 * 1024 + 7),
        "config.json": b'{"architectures": ["TinyForCausalLM"]}\n',
        "model.safetensors.index.json": b'{"weight_map": {}}\n',
        "tokenizer/tokenizer.json": rng.randbytes(40_000),
        "generation_config.json": b"",
    }


def upload(bucket: Bucket, prefix: str, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        bucket.put(prefix + path, data)


def tree(dest: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(dest.rglob("*")):
        rel = path.relative_to(dest).as_posix()
        # hgxserve-manifest.json is the manifest sync places next to the model, not model data.
        if path.is_file() and not rel.startswith(".hgxserve/") and rel != "hgxserve-manifest.json":
            out[rel] = path.read_bytes()
    return out


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at tmp_path/small while the block runs; the test is skipped where it cannot
    be mounted (not root, or no tmpfs)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
