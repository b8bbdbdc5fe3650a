"""API key files (hgxserve.base.apikeys): a private regular file holding a key of at least
MIN_API_KEY_LENGTH characters, wherever hgxserve reads one (the proxy at start, the release
gate, `hgxserve bench --api-key-file`); refusals name the file, never the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.base.apikeys import KeyFileError, key_problem, read_key_file
from hgxserve.base.defaults import MIN_API_KEY_LENGTH
from hgxserve.cli.bench import bench
from hgxserve.proxy.config import ProxyConfigError, read_api_key
from hgxserve.release.gate import GateError, GateSpec, _api_key

KEY = "k" * 8 + "0123456789abcdef0123456789abcdef"  # 40 characters
REPO = Path(__file__).resolve().parents[2]


def key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "api-key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_private_file_with_a_full_length_key_is_read(tmp_path: Path) -> None:
    assert MIN_API_KEY_LENGTH == 32
    assert read_key_file(str(key_file(tmp_path))) == KEY
    assert read_key_file(str(key_file(tmp_path, mode=0o400))) == KEY  # stricter is fine
    minimum = "0123456789abcdef" + "fedcba9876543210"
    assert read_key_file(str(key_file(tmp_path, minimum))) == minimum  # exactly the minimum
    assert read_api_key(str(key_file(tmp_path))) == KEY


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666])
def test_group_or_other_bits_are_refused(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, mode=mode)
    with pytest.raises(KeyFileError) as err:
        read_key_file(str(path))
    assert str(err.value) == (
        f"{path}: the API key file: mode {mode:04o} lets group or others at it (chmod 600)"
    )
    with pytest.raises(ProxyConfigError, match="lets group or others at it"):
        read_api_key(str(path))
    assert KEY not in str(err.value)


def test_a_short_or_empty_key_is_refused_without_saying_it(tmp_path: Path) -> None:
    short = "s3cr3t-0123456789"
    with pytest.raises(KeyFileError) as err:
        read_key_file(str(key_file(tmp_path, short + "\n")))
    assert "the API key in it: 17 characters, shorter than the 32 required" in str(err.value)
    assert short not in str(err.value)
    with pytest.raises(KeyFileError, match="the API key in it: empty"):
        read_key_file(str(key_file(tmp_path, "\n")))
    assert key_problem(KEY[:31]) is not None and key_problem(KEY[:32]) is None


def test_not_a_regular_file_missing_or_too_large_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="the API key file: not a regular file"):
        read_key_file(str(fifo))  # refused at once, not a read that waits for a writer
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(str(tmp_path))
    with pytest.raises(KeyFileError, match="cannot read the API key file: No such file"):
        read_key_file(str(tmp_path / "missing"))
    with pytest.raises(KeyFileError, match="larger than 4096 bytes"):
        read_key_file(str(key_file(tmp_path, "x" * 5000)))


def test_the_gate_and_bench_use_the_same_check(tmp_path: Path) -> None:
    good = key_file(tmp_path)
    spec = GateSpec(proxy_url="http://127.0.0.1:1", served_name="m", api_key_file=str(good))
    assert _api_key(spec) == KEY
    good.chmod(0o644)
    with pytest.raises(GateError, match="proxy API key file: mode 0644"):
        _api_key(spec)
    result = CliRunner().invoke(
        bench,
        ["run", str(REPO / "topologies/demo/demo-pd.yml"), "--api-key-file", str(good)],
    )
    assert result.exit_code != 0
    assert "the API key file: mode 0644 lets group or others at it" in result.output
    assert KEY not in result.output
