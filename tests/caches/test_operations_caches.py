"""caches.restored / caches.baked / the caches role: commands only on mismatch, noop otherwise."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hgxserve.facts.caches import CacheKeyFacts, CacheState  # noqa: E402
from hgxserve.operations.caches import baked, restored  # noqa: E402
from hgxserve.parsers.probes import parse_cache_state  # noqa: E402
from roles.caches import caches  # noqa: E402
from tests.test_operations import run_deploy, run_operation  # noqa: E402

SHA = "ab" * 32
ROOT = "/var/cache/hgxserve"
STATE = "hgxserve.facts.caches.CacheState"


@pytest.fixture()
def store(tmp_path):
    (tmp_path / "full-1").mkdir()
    (tmp_path / "full-1" / f"{SHA}.tar.zst").write_bytes(b"archive")
    (tmp_path / "full-1.json").write_text(json.dumps({"sha256": SHA, "key": "k1"}))
    return tmp_path


NOT_OWNED = "hgxserve.facts.caches.CacheNotOwned"
CHOWN = (
    f"find {ROOT}/k1 -depth '!' -user hgxserve-engine '(' -type d -o -links 1 ')' "
    "-exec chown --no-dereference hgxserve-engine:hgxserve-engine '{}' +"
)


def facts(state, not_owned=()):
    return {
        STATE: {f"root={ROOT}": state},
        NOT_OWNED: {f"root={ROOT}, user=hgxserve-engine": list(not_owned)},
    }


def test_restored_is_a_noop_when_the_marker_matches(store):
    state = {"k1": {"full_key": "full-1", "archive_sha256": SHA}}
    commands, noops = run_operation(
        restored, {"key": "k1", "full_key": "full-1", "store": str(store)}, facts(state)
    )
    assert commands == []
    assert noops == [f"cache k1 already holds full-1 ({SHA[:12]})"]


def test_a_cache_restored_as_root_is_handed_to_the_engine_user_and_nothing_else(store):
    """A key directory restored before the engines ran unprivileged: only its owner changes."""
    state = {"k1": {"full_key": "full-1", "archive_sha256": SHA}}
    commands, noops = run_operation(
        restored, {"key": "k1", "full_key": "full-1", "store": str(store)}, facts(state, ["k1"])
    )
    assert commands == [CHOWN] and noops == []
    kwargs = {"key": "k1", "full_key": "full-1", "topology": "t", "engine": "e", "facts": {},
              "store": str(store)}  # fmt: skip
    commands, noops = run_operation(baked, kwargs, facts(state, ["k1"]))
    assert commands == [CHOWN] and noops == []


def test_cache_not_owned_fact_names_keys_with_foreign_entries():
    from hgxserve.facts.caches import CacheNotOwned

    fact = CacheNotOwned()
    command = fact.command("/var/cache/my root", "hgxserve-engine")
    assert "'/var/cache/my root'/*/" in command
    assert 'find "$d" ! -user hgxserve-engine \\( -type d -o -links 1 \\) -print -quit' in command
    # every key counts as not owned while the user does not exist yet
    assert command.startswith("if id -u hgxserve-engine >/dev/null 2>&1; then ")
    assert fact.process(["k2", "", "k1 "]) == ["k1", "k2"]


@pytest.mark.parametrize(
    "state",
    [
        {},  # nothing there
        {"k1": {"full_key": "full-0", "archive_sha256": SHA}},  # other host facts (driver...)
        {"k1": {"full_key": "full-1", "archive_sha256": "cd" * 32}},  # a newer bake
    ],
)
def test_restored_pushes_and_restores_on_mismatch(store, state):
    commands, _ = run_operation(
        restored, {"key": "k1", "full_key": "full-1", "store": str(store)}, facts(state)
    )
    remote = f"{ROOT}/.archives/{SHA}.tar.zst"
    assert commands == [
        f"mkdir -p {ROOT}/.archives",
        ["upload", "archive", remote],
        f"/opt/hgxserve/bin/hgxserve cache restore --archive {remote} --dir {ROOT}/k1 "
        f"--sha256 {SHA} --key full-1",
        f"rm -f {remote}",
        CHOWN,  # restored as root, written by the engines as hgxserve-engine
    ]


def test_restored_resolves_the_archive_late_when_baked_in_this_run(tmp_path):
    commands, _ = run_operation(
        restored, {"key": "k1", "full_key": "full-1", "store": str(tmp_path)}, facts({})
    )
    assert commands == [["call", "_push_and_restore_late", {}], CHOWN]


def test_role_bakes_on_the_baker_and_restores_elsewhere(tmp_path):
    topo = tmp_path / "t.yml"
    topo.write_text("name: t\n")
    entry = {"engine": "combined-0", "key": "k1", "full_key": "full-1", "facts": {"sm_count": 78}}
    kwargs = {
        "engines": [entry, {**entry, "engine": "decode-0"}],  # same key: one operation
        "topology": str(topo),
        "store": str(tmp_path),
        "policy": "bake",
        "bakers": {"full-1": "testhost"},
    }
    ops = run_deploy(caches, kwargs, facts({}))
    assert [name for name, _ in ops] == ["Restore JIT caches | Bake JIT cache k1 (combined-0)"]
    commands = ops[0][1]
    assert commands[0] == f"mkdir -p {ROOT}/.bake {ROOT}/.archives"
    assert commands[1] == ["upload", "name: t\n", f"{ROOT}/.bake/t.yml"]
    assert commands[2] == ["upload", '{"sm_count": 78}', f"{ROOT}/.bake/full-1.facts.json"]
    assert commands[3].startswith("/opt/hgxserve/bin/hgxserve cache bake --topology ")
    assert "--pack-to /var/cache/hgxserve/.archives/" in commands[3]
    assert commands[3].endswith(" --user hgxserve-engine")  # the engine bakes as its unit runs
    assert commands[4] == CHOWN  # the record and marker the bake wrote as root
    assert commands[5] == ["call", "_fetch_baked", {}]
    kwargs["bakers"] = {"full-1": "other-host"}
    ops = run_deploy(caches, kwargs, facts({}))
    assert [name for name, _ in ops] == ["Restore JIT caches | Restore JIT cache k1 (combined-0)"]


def test_role_policy_auto_bakes_like_bake_but_not_multi_node_engines(tmp_path):
    topo = tmp_path / "t.yml"
    topo.write_text("name: t\n")
    entry = {"engine": "combined-0", "key": "k1", "full_key": "full-1", "facts": {}}
    kwargs = {
        "engines": [entry],
        "topology": str(topo),
        "store": str(tmp_path),
        "bakers": {"full-1": "testhost"},
    }  # policy: the default, auto
    ops = run_deploy(caches, kwargs, facts({}))
    assert [name for name, _ in ops] == ["Restore JIT caches | Bake JIT cache k1 (combined-0)"]
    kwargs["engines"] = [{**entry, "multi_node": True}]
    assert run_deploy(caches, kwargs, facts({})) == []  # nothing to restore, nothing baked


def test_role_policy_off_does_nothing(tmp_path):
    ops = run_deploy(
        caches, {"engines": [], "topology": "t", "store": str(tmp_path), "policy": "off"}, {}
    )
    assert ops == []


def test_baked_is_a_noop_when_baked_and_fetched(store):
    state = {"k1": {"full_key": "full-1", "archive_sha256": SHA}}
    kwargs = {"key": "k1", "full_key": "full-1", "topology": "t", "engine": "e", "facts": {},
              "store": str(store)}  # fmt: skip
    commands, noops = run_operation(baked, kwargs, facts(state))
    assert commands == [] and noops == ["cache k1 already baked as full-1"]


def test_cache_state_fact_parses_markers_and_skips_broken_ones():
    lines = [
        "##/var/cache/hgxserve/k1/.hgxserve-cache.json",
        '{"full_key": "f1",',
        ' "archive_sha256": "ab"}',
        "",
        "##/var/cache/hgxserve/k2/.hgxserve-cache.json",
        "{truncated",
    ]
    assert parse_cache_state(lines) == {"k1": {"full_key": "f1", "archive_sha256": "ab"}}
    assert "/var/cache/hgxserve/*/.hgxserve-cache.json" in CacheState().command(ROOT)


def test_cache_key_facts_fact_reads_probe_and_manifest_digest():
    out = [
        '{"engine_version": "0.26.0", "sm_count": 78, "gpu_name": "NVIDIA H20"}',
        "##manifest " + "c" * 64,
    ]
    assert CacheKeyFacts().process(out) == {
        "engine_version": "0.26.0",
        "gpu_name": "NVIDIA H20",
        "model_manifest_sha256": "c" * 64,
        "sm_count": 78,
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another user needs root")
def test_hand_over_gives_the_tree_to_the_user_but_never_a_link_target_or_hard_link(tmp_path):
    """Run for real: what the fact finds is what the command hands over, then nothing is left
    (a second run changes nothing); a symlink out of the cache changes owner itself, its
    target does not; a file with a second hard link (one elsewhere, where protected_hardlinks
    is off) keeps its owner."""
    import pwd
    import subprocess

    from hgxserve.facts.caches import CacheNotOwned
    from hgxserve.operations.caches import hand_over

    user = "daemon"  # a user whose group of the same name exists on Debian
    outside = tmp_path / "outside"
    outside.write_text("root's\n")
    key = tmp_path / "root" / "k1"
    (key / "vllm" / "deep").mkdir(parents=True)
    (key / "vllm" / "deep" / "kernel.so").write_text("x")
    (key / "escape").symlink_to(outside)
    os.link(outside, key / "vllm" / "linked")

    def sh(command: str) -> str:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True).stdout

    fact = CacheNotOwned()
    before = fact.process(sh(fact.command(str(tmp_path / "root"), user)).splitlines())
    assert before == ["k1"]
    subprocess.run(["sh", "-c", hand_over(str(tmp_path / "root"), "k1", user).get_raw_value()],
                   check=True)  # fmt: skip
    uid = pwd.getpwnam(user).pw_uid
    for path in (key, key / "vllm", key / "vllm" / "deep", key / "vllm" / "deep" / "kernel.so"):
        assert os.lstat(path).st_uid == uid, path
    assert os.lstat(key / "escape").st_uid == uid  # the link itself
    assert os.stat(outside).st_uid == 0  # not what it points at, nor the hard-linked file
    assert fact.process(sh(fact.command(str(tmp_path / "root"), user)).splitlines()) == []
