"""The engine user cannot reach root through its unit, and every engine gets the proxy's key.

A venv engine runs as `hgxserve-engine`, which can write its key directory, its run directory
and its home. No line of its unit that runs as root (`+`) may act inside those: GNU `install -d`
as root follows a link the user planted there and hands the link's target (`/opt/hgxserve/bin`,
whose `hgxserve` the `+` lines run) to the user. The key reaches what the engine process
itself reads: podman forwards it by name into the container, SGLang gets `--api-key` in memory.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, TEST_TOPOLOGIES, topology
from test_proxy_unit import keyed

from hgxserve.base.enginekey import ENGINE_KEY_VAR, SGLANG_KEY_LAUNCHER
from hgxserve.base.paths import AGENT_PREFIX, ENGINE_HOME
from hgxserve.render import render_host, render_topology
from hgxserve.topology import load_topology

ALL_TOPOLOGIES = sorted(ROOT.glob("topologies/**/*.yml")) + sorted(TEST_TOPOLOGIES.glob("*.yml"))
WRAPPER = [f"{AGENT_PREFIX}/bin/hgxserve", "gpus", "exec-with-credentials"]


def _values(content: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in content.splitlines() if line.startswith(key + "=")]


def _root_lines(content: str) -> list[list[str]]:
    """The words of every Exec*= line that runs with full privileges (`+`)."""
    out = []
    for line in content.splitlines():
        key, _, value = line.partition("=")
        if key.startswith("Exec") and value.startswith("+"):
            out.append(shlex.split(value[1:]))
    return out


def _inside(path: str, top: str) -> bool:
    return path.startswith(top.rstrip("/") + "/")


def _venv_units(path: Path):
    topo = load_topology(path)
    for rendered in render_topology(topo).values():
        for unit in rendered.units:
            if unit.engine is None or unit.role == "watch":
                continue
            runtime = topo.engines[unit.engine].runtime
            if runtime is not None and not runtime.is_container:
                yield unit


@pytest.mark.parametrize("path", ALL_TOPOLOGIES, ids=lambda p: p.stem)
def test_no_root_line_acts_inside_a_directory_the_engine_user_writes(path: Path):
    for unit in _venv_units(path):
        key_dir = os.path.dirname(unit.env["VLLM_CACHE_ROOT"])
        run_dir = os.path.dirname(unit.env["TMPDIR"])
        writable = [key_dir, run_dir, ENGINE_HOME]
        for words in _root_lines(unit.content):
            for word in words:
                for top in writable:
                    assert not _inside(word, top), (unit.name, word, words)
        # systemd makes the two tops for the user; the user makes what is inside them
        assert _values(unit.content, "CacheDirectory") == [key_dir.removeprefix("/var/cache/")]
        assert _values(unit.content, "StateDirectory") == [run_dir.removeprefix("/var/lib/")]
        assert "CacheDirectoryMode=0750" in unit.content
        assert "StateDirectoryMode=0750" in unit.content
        make = [v for v in _values(unit.content, "ExecStartPre") if f"{key_dir}/" in v]
        assert len(make) == 1 and make[0].startswith("/usr/bin/mkdir -p "), make
        # root's binaries out of the engine's reach: the file system read-only but its dirs
        lines = unit.content.splitlines()
        assert "ProtectSystem=strict" in lines
        rw = shlex.split(_values(unit.content, "ReadWritePaths")[0])
        assert not any(p.lstrip("-").startswith(AGENT_PREFIX) for p in rw), rw


def test_a_cache_root_systemd_does_not_manage_is_made_in_its_parent_only(tmp_path: Path):
    text = (ROOT / "topologies/demo/demo-baseline.yml").read_text()
    path = tmp_path / "t.yml"
    path.write_text(text + "cache: {root: /srv/hgx-cache}\n")
    topo = load_topology(path)
    (unit,) = [u for u in render_host(topo, "hgx-a").units if u.engine == "combined-0"]
    key_dir = os.path.dirname(unit.env["VLLM_CACHE_ROOT"])
    assert key_dir.startswith("/srv/hgx-cache/")
    (owned,) = _root_lines(unit.content)[:1]
    # the key directory itself, in root's cache.root; nothing inside it
    assert owned[:2] == ["/usr/bin/install", "-d"] and owned[-1] == key_dir
    assert _values(unit.content, "CacheDirectory") == []
    assert _values(unit.content, "StateDirectory") == ["hgxserve/run/combined-0"]


ENGINE_UID = 65534  # nobody: stands in for hgxserve-engine on this machine


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("install") is None, reason="needs root and coreutils"
)
def test_a_link_the_engine_user_plants_hands_nothing_of_root_over():
    """The demo's unit lines, run as the unit runs them (`+` as root, the others as the user)
    on a copy of its directories, twice: between the starts the user swaps a directory of its
    own for a link to a root-owned folder that stands for /opt/hgxserve/bin."""
    topo = topology("demo/demo-baseline.yml")
    (unit,) = [u for u in render_host(topo, "hgx-a").units if u.engine == "combined-0"]
    key_dir = os.path.dirname(unit.env["VLLM_CACHE_ROOT"])
    run_dir = os.path.dirname(unit.env["TMPDIR"])
    base = Path(tempfile.mkdtemp(prefix="hgx-priv-", dir="/tmp"))
    try:
        base.chmod(0o755)
        victim = base / "opt-bin"
        victim.mkdir()
        (victim / "hgxserve").write_text("#!/bin/sh\n")
        here = {key_dir: str(base / "cache" / "k"), run_dir: str(base / "run" / "e")}

        def local(word: str) -> str:
            for top, there in here.items():
                if word == top or _inside(word, top):
                    return there + word[len(top) :]
            return {"hgxserve-engine": str(ENGINE_UID)}.get(word, word)

        def start() -> None:
            # systemd's part: CacheDirectory=/StateDirectory= make each top in its root-owned
            # parent and give it to User= (a top is never a link: its parent is root's)
            for top in here.values():
                os.makedirs(os.path.dirname(top), mode=0o755, exist_ok=True)
                os.makedirs(top, mode=0o750, exist_ok=True)
                os.chown(top, ENGINE_UID, ENGINE_UID, follow_symlinks=False)
            for value in _values(unit.content, "ExecStartPre"):
                root = value.startswith("+")
                words = [local(w) for w in shlex.split(value.lstrip("+-"))]
                if not any(str(base) in w for w in words):
                    continue  # the agent's checks: no directories
                user = {} if root else {"user": ENGINE_UID, "group": ENGINE_UID}
                subprocess.run(words, check=True, capture_output=True, **user)  # type: ignore[call-overload]

        start()
        # the engine user replaces directories of its own with links to root's folder
        for planted in (f"{here[run_dir]}/tmp", f"{here[key_dir]}/triton"):
            shutil.rmtree(planted)
            os.symlink(victim, planted)
            os.lchown(planted, ENGINE_UID, ENGINE_UID)
        start()  # the next start: whatever follows the links acts as the user, not as root
        assert victim.stat().st_uid == 0 and (victim / "hgxserve").stat().st_uid == 0
        assert oct(victim.stat().st_mode & 0o777) == "0o755"
    finally:
        shutil.rmtree(base)


# --------------------------------------------------------------------------------------------
# every engine gets its key
# --------------------------------------------------------------------------------------------


def _exported(argv_text: str) -> list[str]:
    """The variables `exec-with-credentials VAR=name ... --` exports in an ExecStart= value."""
    words = shlex.split(argv_text)
    if words[:3] != WRAPPER:
        return []
    return [w.split("=", 1)[0] for w in words[3 : words.index("--")]]


@pytest.mark.parametrize("path", ALL_TOPOLOGIES, ids=lambda p: p.stem)
def test_container_engines_receive_every_exported_secret_inside(path: Path):
    topo = load_topology(path)
    for rendered in render_topology(topo).values():
        for unit in rendered.units:
            runtime = topo.engines[unit.engine].runtime if unit.engine in topo.engines else None
            if unit.role == "watch" or runtime is None or not runtime.is_container:
                continue
            exported = _exported(_values(unit.content, "ExecStart")[0])
            names = [unit.argv[i + 1] for i, w in enumerate(unit.argv) if w == "--env"]
            assert set(exported) <= set(names), (unit.name, exported, names)
            assert all("=" not in n for n in names)


def test_a_keyed_container_vllm_engine_gets_vllm_api_key_inside():
    unit = render_host(topology("h20-v4flash-1p1d-2node.yml"), "h20-a").units[0]
    assert ENGINE_KEY_VAR in _exported(_values(unit.content, "ExecStart")[0])
    # podman's own options, before the image: `--env NAME` passes the tool's value inside
    podman_options = unit.argv[: unit.argv.index("--entrypoint")]
    assert ("--env", ENGINE_KEY_VAR) in zip(podman_options, podman_options[1:], strict=False)


KEY = "k3y-of-the-engines-0123456789abcdef-do-not-leak"


def test_a_keyed_sglang_engine_gets_api_key_and_no_command_line_shows_it(tmp_path: Path):
    topo = keyed("h200-dsv32-sglang-dp8.yml")
    host = topo.engines["sglang-0"].hosts[0]
    (unit,) = [u for u in render_host(topo, host).units if u.engine == "sglang-0"]
    venv = topo.engines["sglang-0"].runtime.venv.rstrip("/")
    assert unit.argv[:4] == [f"{venv}/bin/python", "-c", SGLANG_KEY_LAUNCHER, f"{venv}/bin/sglang"]
    assert unit.argv[4] == "serve" and "--api-key" not in unit.argv
    assert _exported(_values(unit.content, "ExecStart")[0]) == [ENGINE_KEY_VAR]
    # the launcher, run as the unit runs it, in front of a stand-in `sglang` that reports what
    # its process received: --api-key with the key, which neither its command line nor its
    # environment (children inherit that) holds
    report = tmp_path / "received.json"
    program = tmp_path / "sglang"
    program.write_text(
        "import json, os, sys\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        f"json.dump({{'argv': sys.argv, 'cmdline': cmdline, 'env': dict(os.environ)}}, "
        f"open({str(report)!r}, 'w'))\n"
    )
    argv = [sys.executable, "-c", SGLANG_KEY_LAUNCHER, str(program), *unit.argv[4:]]
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), ENGINE_KEY_VAR: KEY}
    subprocess.run(argv, env=env, check=True, timeout=60)
    got = json.loads(report.read_text())
    assert got["argv"][-2:] == ["--api-key", KEY]
    assert got["argv"][1:-2] == unit.argv[4:]
    assert KEY not in got["cmdline"]
    assert "--api-key" not in got["cmdline"].split("\0")
    assert ENGINE_KEY_VAR not in got["env"]
    assert KEY not in unit.content


def test_a_keyed_sglang_container_engine_gets_the_launcher_and_the_key_by_name():
    topo = keyed("sglang-pd-image.yml", kind="hgxserve")
    unit = render_host(topo, "h20-a").units[0]
    i = unit.argv.index("--entrypoint")
    assert unit.argv[i + 1] == "python3"
    assert unit.argv[i + 3 : i + 6] == ["-c", SGLANG_KEY_LAUNCHER, "sglang"]
    assert ("--env", ENGINE_KEY_VAR) in zip(unit.argv[:i], unit.argv[1:i], strict=False)
    assert ENGINE_KEY_VAR in _exported(_values(unit.content, "ExecStart")[0])
