"""The agent wheelhouse is built for the host's Python and platform, not the controller's."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

import pytest

from hgxserve.runtime import agent_build, wheelhouse
from hgxserve.runtime.wheelhouse import HostPlatform, missing_requirements

JAMMY = HostPlatform("3.10", "x86_64", "2.35")
TRIXIE = HostPlatform("3.13", "x86_64", "2.41")


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {line}\n" for line in requires)
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_supported_pythons_are_310_to_313():
    assert [agent_build.python_problem(v) for v in ("3.10", "3.11.2", "3.12", "3.13.5")] == [
        None
    ] * 4
    assert agent_build.python_problem("3.9.18") == (
        "expected Python 3.10 to 3.13 for the hgxserve agent, found Python 3.9.18"
    )
    assert agent_build.python_problem("3.14") is not None
    assert agent_build.python_problem(None).endswith("found no python3")


def test_markers_are_the_hosts_not_the_controllers(tmp_path: Path):
    """pip evaluates markers for the controller's interpreter even with --python-version: a
    3.10 host's `async-timeout; python_version < "3.11"` is found missing and fetched."""
    _wheel(
        tmp_path,
        "aiohttp",
        "3.14.5",
        [
            "yarl>=1.25",
            'async-timeout<6.0,>=4.0; python_version < "3.11"',
            'typing_extensions>=4.4; python_version < "3.13"',
            'aiodns>=3.3.0; extra == "speedups"',
        ],
    )
    _wheel(tmp_path, "yarl", "1.25.1", [])
    assert missing_requirements(tmp_path, JAMMY) == [
        "async-timeout<6.0,>=4.0",
        "typing_extensions>=4.4",
    ]
    assert missing_requirements(tmp_path, TRIXIE) == []


def test_download_rounds_until_the_hosts_markers_hold(tmp_path: Path, monkeypatch):
    calls: list[list[str]] = []

    class Done:
        returncode = 0
        stderr = ""

    def fake_pip(cmd: list[str], **_: object) -> Done:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        if len(calls) == 1:
            _wheel(dest, "aiohttp", "3.14.5", ['async-timeout>=4; python_version < "3.11"'])
        else:
            _wheel(dest, "async_timeout", "5.0.1", [])
        return Done()

    monkeypatch.setattr(wheelhouse.subprocess, "run", fake_pip)
    wheelhouse.download_wheels(["aiohttp==3.14.5"], JAMMY, tmp_path, [])
    assert len(calls) == 2 and calls[1][-1] == "async-timeout>=4"
    assert calls[0][calls[0].index("--python-version") :][:2] == ["--python-version", "3.10"]


def test_agent_wheelhouse_per_platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Dependencies once per (pyproject, platform), hgxserve's own wheel once for all; the key
    names the source and the platform."""
    downloads: list[str] = []

    def fake_download(reqs: list[str], platform: HostPlatform, dest: Path, extra: list[str]):
        downloads.append(platform.tag())
        _wheel(dest, "zstandard", "0.25.0", [])

    builds: list[Path] = []

    def fake_pip_wheel(args: list[str], dest: Path) -> None:
        builds.append(dest)
        _wheel(dest, "hgxserve", "0.1.0", [])

    monkeypatch.setattr(agent_build, "CACHE", tmp_path)
    monkeypatch.setattr(agent_build, "download_wheels", fake_download)
    monkeypatch.setattr(agent_build, "_pip_wheel", fake_pip_wheel)
    agent_build.wheelhouse.cache_clear()
    try:
        jammy, jammy_key = agent_build.wheelhouse(JAMMY)
        trixie, trixie_key = agent_build.wheelhouse(TRIXIE)
        assert jammy_key.endswith("-cp310-x86_64-glibc2.35")
        assert trixie_key.endswith("-cp313-x86_64-glibc2.41")
        assert jammy_key.split("-")[0] == trixie_key.split("-")[0]  # one source digest
        assert jammy != trixie
        with tarfile.open(trixie) as tar:
            assert tar.getnames() == [
                "hgxserve-0.1.0-py3-none-any.whl",
                "hgxserve.lock",
                "requirements.lock",
                "zstandard-0.25.0-py3-none-any.whl",
            ]
            lock = tar.extractfile("requirements.lock")
            assert lock is not None
            pins = lock.read().decode().splitlines()
            assert [p.split(" --hash=sha256:")[0] for p in pins] == [
                "hgxserve==0.1.0",
                "zstandard==0.25.0",
            ]
        agent_build.wheelhouse.cache_clear()
        assert agent_build.wheelhouse(JAMMY) == (jammy, jammy_key)
        assert downloads == ["cp310-x86_64-glibc2.35", "cp313-x86_64-glibc2.41"]
        assert len(builds) == 1
    finally:
        agent_build.wheelhouse.cache_clear()
