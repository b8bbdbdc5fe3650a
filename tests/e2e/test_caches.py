"""JIT cache distribution end to end: the real pyinfra CLI runs `deploys/caches.py` over SSH on
the three test hosts; one host bakes per (GPU kind, key), the controller store gets its archive,
the other hosts get it pushed and restored, and only missing keys move on later runs.

The engine is FAKE: `tests/caches/fake_jit_engine.py`, installed by this test as the runtime
`/opt/fakejit` (`bin/vllm` runs it, `bin/python` is the host's python3). It compiles nothing; it
logs vLLM/TileLang JIT lines and writes files into the cache directories the unit pins, which is
what the bake, pack, push and restore work on. Weights come from the demo lab's local S3.

Everything this module creates on the hosts (the fake runtime, its cache root, its run
directories, any fake engine still running) is removed at the end.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testbed import demo
from testbed import hosts as testbed_hosts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
FAKE_ENGINE = REPO / "tests/caches/fake_jit_engine.py"
FAKE_RUNTIME = "/opt/fakejit"
# Own root and port, so a concurrent session's engines and caches on these hosts are untouched.
CACHE_ROOT = "/var/cache/hgxserve-e2e-caches"
PORT = 8171
ENGINE_PREFIX = "fakejit-"
MARKER = ".hgxserve-cache.json"
# the stage's engine user operations on each host (roles/engine_user.py): group, user, home
ENGINE_USER = "hgxserve-engine"
ENGINE_USER_OPS = 3
TOPOLOGY_GPU = {"h200": "H200", "h20": "H20-3e"}  # testbed kind -> topology `gpu`

FAKE_SHIM = f"""#!/bin/sh
# FAKE vLLM for hgxserve's cache e2e test (tests/e2e/test_caches.py): it compiles nothing, it
# only logs JIT lines and writes cache files the way a JIT engine would.
exec /usr/bin/python3 {FAKE_RUNTIME}/fake_jit_engine.py "$@"
"""

# Kill by PID only the fake engine this module installed (its path is unique to this test).
CLEANUP = (
    f"for p in $(pgrep -f '^/usr/bin/python3 {FAKE_RUNTIME}/fake_jit_engine.py'); do "
    'kill "$p"; done; '
    f"rm -rf {CACHE_ROOT} {FAKE_RUNTIME} /var/lib/hgxserve/run/{ENGINE_PREFIX}*; true"
)

# sha256 over every file of a key directory except the host-local restore marker.
TREE_DIGEST = (
    "cd {dir} && find . -type f ! -name " + MARKER + " -print0 | LC_ALL=C sort -z "
    "| xargs -0 sha256sum | sha256sum | cut -d' ' -f1"
)


@dataclass
class Lab:
    bed: testbed_hosts.Testbed
    topology: Path
    store: Path
    kinds: dict[str, str]
    started_s3: bool
    timings: dict[str, float] = field(default_factory=dict)

    def deploy(self) -> subprocess.CompletedProcess[str]:
        return self.bed.pyinfra(
            "deploys/caches.py",
            "--data",
            f"topology={self.topology}",
            "--data",
            f"cache_store={self.store}",
        )


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def grand_total(proc: subprocess.CompletedProcess[str]) -> tuple[str, ...]:
    """(operations, success, error, no change) from pyinfra's results table."""
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(proc))
    assert match, output(proc)[-3000:]
    return match.groups()


def host_results(proc: subprocess.CompletedProcess[str], operation: str) -> dict[str, str]:
    """{host: Success | Skipped | No changes | Error} for the operation named `operation`."""
    found: dict[str, str] = {}
    for block in output(proc).split("--> Starting operation:")[1:]:
        title, _, body = block.partition("\n")
        if operation in title:
            for host, result in re.findall(r"^\s+\[(\S+)\] (Success|Skipped|No changes|Error)",
                                           body, re.M):  # fmt: skip
                found[host] = result
    return found


def s3_running() -> bool:
    if not demo.STATE.exists():
        return False
    pid = json.loads(demo.STATE.read_text())["pid"]
    return Path(f"/proc/{pid}").exists()


def topology_text(kinds: dict[str, str]) -> str:
    """The demo lab with one combined TP8 engine per host (fake runtime) and `cache: bake`."""
    hosts = "".join(
        f"  {name}: {{address: 10.77.0.{11 + i}, gpu: {TOPOLOGY_GPU[kind]}, gpus: 8}}\n"
        for i, (name, kind) in enumerate(kinds.items())
    )
    engines = "".join(
        f"  {ENGINE_PREFIX}{i}:\n    role: combined\n"
        f"    place: {{{name}: [0, 1, 2, 3, 4, 5, 6, 7]}}\n    tp: 8\n    port: {PORT}\n"
        for i, name in enumerate(kinds)
    )
    combined = ", ".join(f"{ENGINE_PREFIX}{i}" for i in range(len(kinds)))
    return f"""\
name: demo-caches
description: Demo lab, one combined engine per host on a FAKE JIT runtime, caches baked once
hosts:
{hosts}model:
  name: tiny
  served_name: tiny
  path: /models/tiny
  source:
    s3:
      endpoint: {demo.S3_ENDPOINT}
      bucket: {demo.BUCKET}
      prefix: {demo.PREFIX}
      addressing: path
      credentials: {{env_file: /etc/hgxserve/s3.env}}
defaults:
  engine: vllm
  runtime: {{venv: {FAKE_RUNTIME}}}
  args:
    max_model_len: 256
    max_num_seqs: 8
cache: {{policy: bake, root: {CACHE_ROOT}}}
engines:
{engines}proxy:
  host: {next(iter(kinds))}
  listen: 0.0.0.0:8007
  combined: [{combined}]
warmup:
  - {{input: 64, output: 16, concurrency: 4}}
"""


def install_fake_runtime(bed: testbed_hosts.Testbed, name: str) -> None:
    script = (
        f"set -e; mkdir -p {FAKE_RUNTIME}/bin; cat > {FAKE_RUNTIME}/fake_jit_engine.py; "
        f"printf %s {shlex.quote(FAKE_SHIM)} > {FAKE_RUNTIME}/bin/vllm; "
        f"chmod 0755 {FAKE_RUNTIME}/bin/vllm; ln -sfn /usr/bin/python3 {FAKE_RUNTIME}/bin/python"
    )
    subprocess.run(bed.ssh_argv(name, script), input=FAKE_ENGINE.read_text(), text=True, check=True)


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = tmp_path_factory.mktemp("caches")
    started_s3 = not s3_running()
    kinds = {h.name: h.gpu for h in testbed.hosts}
    topology = work / "demo-caches.yml"
    topology.write_text(topology_text(kinds))
    the_lab = Lab(testbed, topology, work / "store", kinds, started_s3)
    try:
        for name in testbed.names:
            testbed.ssh(name, CLEANUP, check=True)
            install_fake_runtime(testbed, name)
        demo.prepare(testbed.names, work / "demo")
        proc = testbed.pyinfra(
            "deploys/site.py", "--data", f"topology={topology}", "--data", "stages=weights"
        )
        assert proc.returncode == 0, output(proc)[-4000:]
        yield the_lab
    finally:
        for name in testbed.names:
            testbed.ssh(name, CLEANUP)
        if started_s3:
            demo.stop_s3()
        if the_lab.timings:
            print("\ncache distribution timings: " + ", ".join(
                f"{k} {v:.1f} s" for k, v in the_lab.timings.items()
            ))  # fmt: skip


def render_key(lab: Lab) -> str:
    proc = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "cache", "key", "--topology", str(lab.topology),
         "--engine", f"{ENGINE_PREFIX}0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stdout.strip()


def marker(lab: Lab, host: str, key: str) -> dict:
    proc = lab.bed.ssh(host, f"cat {CACHE_ROOT}/{key}/{MARKER}", check=True)
    return json.loads(proc.stdout)


def tree_digest(lab: Lab, host: str, key: str) -> str:
    proc = lab.bed.ssh(host, TREE_DIGEST.format(dir=f"{CACHE_ROOT}/{key}"), check=True)
    return proc.stdout.strip()


def bakers(lab: Lab) -> dict[str, str]:
    """Expected baker per GPU kind: the first host of that kind in topology order."""
    first: dict[str, str] = {}
    for name, kind in lab.kinds.items():
        first.setdefault(kind, name)
    return first


def test_first_run_bakes_once_per_kind_and_restores_everywhere_else(lab: Lab) -> None:
    started = time.monotonic()
    proc = lab.deploy()
    lab.timings["first run"] = time.monotonic() - started
    assert proc.returncode == 0, output(proc)[-4000:]
    key = render_key(lab)

    baking = host_results(proc, "Bake JIT cache")
    restoring = host_results(proc, "Restore JIT cache")
    first = bakers(lab)
    for name, kind in lab.kinds.items():
        if first[kind] == name:
            assert baking.get(name) == "Success", output(proc)[-4000:]
        else:
            assert baking.get(name, "Skipped") == "Skipped", output(proc)[-4000:]
            assert restoring.get(name) == "Success", output(proc)[-4000:]

    # One archive per (kind, full key) in the controller store, named by its own sha256.
    indexes = sorted(lab.store.glob("*.json"))
    assert len(indexes) == len(first), [p.name for p in indexes]
    by_baker = {}
    for path in indexes:
        index = json.loads(path.read_text())
        archive = lab.store / path.stem / f"{index['sha256']}.tar.zst"
        digest = subprocess.run(
            ["sha256sum", str(archive)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        assert digest == index["sha256"]
        assert index["key"] == key
        by_baker[index["baked_on"]] = (path.stem, index["sha256"])
    assert set(by_baker) == set(first.values())

    for kind, baker in first.items():
        full_key, sha = by_baker[baker]
        same_kind = [n for n, k in lab.kinds.items() if k == kind]
        digests = set()
        for name in same_kind:
            mark = marker(lab, name, key)
            assert (mark["full_key"], mark["archive_sha256"]) == (full_key, sha), (name, mark)
            digests.add(tree_digest(lab, name, key))
            ls = lab.bed.ssh(name, f"ls -a {CACHE_ROOT}/{key}/tilelang {CACHE_ROOT}", check=True)
            assert "fake_gemm_m64_n16.so" in ls.stdout, (name, ls.stdout)  # warmed kernels
            # the bake ran on the baker only: only it has the engine log
            assert (f".bake-{key}.log" in ls.stdout) == (name == baker), (name, ls.stdout)
        assert len(digests) == 1, digests  # byte-identical caches on every host of the kind
        record = json.loads(
            lab.bed.ssh(baker, f"cat {CACHE_ROOT}/{key}/.hgxserve-bake.json", check=True).stdout
        )
        assert record["host"] == baker and record["settled"] is True
        assert record["rounds"][0]["jit_lines"] > 0 and record["rounds"][-1]["jit_lines"] == 0
        assert record["user"] == ENGINE_USER  # the bake's engine ran as the units' do
    # baked or restored (as root), every cache is the engine user's to write
    for name in lab.bed.names:
        assert not_owned(lab, name, key) == "", name


def not_owned(lab: Lab, host: str, key: str) -> str:
    """What in the key directory the engine user does not own ("" when nothing)."""
    find = f"find {CACHE_ROOT}/{key} ! -user {ENGINE_USER} -printf '%u %p\\n'"
    return lab.bed.ssh(host, find, check=True).stdout


def test_second_run_changes_nothing(lab: Lab) -> None:
    key = render_key(lab)
    before = {n: marker(lab, n, key) for n in lab.bed.names}
    started = time.monotonic()
    proc = lab.deploy()
    lab.timings["no-op run"] = time.monotonic() - started
    assert proc.returncode == 0, output(proc)[-4000:]
    _, success, error, no_change = grand_total(proc)
    assert (success, error) == ("-", "-"), output(proc)[-3000:]
    assert no_change == str(len(lab.bed.names) * (1 + ENGINE_USER_OPS))
    assert "Bake JIT cache" not in output(proc)
    assert {n: marker(lab, n, key) for n in lab.bed.names} == before


def test_only_the_host_missing_the_cache_gets_it(lab: Lab) -> None:
    key = render_key(lab)
    names = lab.bed.names
    victim = names[-1]
    others = names[:-1]
    stat = f"stat -c '%i %Y' {CACHE_ROOT}/{key} {CACHE_ROOT}/{key}/{MARKER}"
    untouched = {n: lab.bed.ssh(n, stat, check=True).stdout for n in others}
    expected = marker(lab, victim, key)
    digest = tree_digest(lab, victim, key)
    lab.bed.ssh(victim, f"rm -rf {CACHE_ROOT}/{key}", check=True)

    started = time.monotonic()
    proc = lab.deploy()
    lab.timings["one-host repair run"] = time.monotonic() - started
    assert proc.returncode == 0, output(proc)[-4000:]
    _, success, error, no_change = grand_total(proc)
    unchanged = len(others) + len(names) * ENGINE_USER_OPS
    assert (success, error, no_change) == ("1", "-", str(unchanged)), output(proc)[-3000:]
    results = host_results(proc, "Restore JIT cache")
    assert results == {victim: "Success", **{n: "No changes" for n in others}}, results
    assert "Bake JIT cache" not in output(proc)  # the store had it: pushed, not baked again
    assert marker(lab, victim, key) == expected
    assert tree_digest(lab, victim, key) == digest
    assert not_owned(lab, victim, key) == ""  # restored as root, handed to the engine user
    assert {n: lab.bed.ssh(n, stat, check=True).stdout for n in others} == untouched


def test_a_cache_left_to_root_is_handed_to_the_engine_user_without_a_restore(lab: Lab) -> None:
    """A host whose cache was restored before the engines ran unprivileged (root's files): the
    next run only hands it over; the one after changes nothing."""
    key = render_key(lab)
    host = lab.bed.names[0]
    expected = marker(lab, host, key)
    digest = tree_digest(lab, host, key)
    inodes = f"stat -c %i {CACHE_ROOT}/{key} {CACHE_ROOT}/{key}/{MARKER}"
    before = lab.bed.ssh(host, inodes, check=True).stdout
    lab.bed.ssh(host, f"chown -R root:root {CACHE_ROOT}/{key}", check=True)
    assert not_owned(lab, host, key) != ""
    proc = lab.deploy()
    assert proc.returncode == 0, output(proc)[-4000:]
    results = host_results(proc, "Restore JIT cache") | host_results(proc, "Bake JIT cache")
    assert {n: r for n, r in results.items() if r != "Skipped"} == {
        n: "Success" if n == host else "No changes" for n in lab.bed.names
    }, output(proc)[-3000:]
    # not restored again (a restore swaps in a new directory and marker) nor baked
    assert lab.bed.ssh(host, inodes, check=True).stdout == before
    assert not_owned(lab, host, key) == ""
    assert marker(lab, host, key) == expected and tree_digest(lab, host, key) == digest
    again = lab.deploy()
    assert again.returncode == 0, output(again)[-4000:]
    assert grand_total(again)[1:3] == ("-", "-"), output(again)[-3000:]


def test_lost_store_is_refilled_from_the_baker_without_a_new_bake(lab: Lab) -> None:
    """A fresh controller (empty store): the baker's packed archive is fetched, nothing else."""
    key = render_key(lab)
    before = {p.name: p.read_text() for p in lab.store.glob("*.json")}
    shutil.rmtree(lab.store)
    proc = lab.deploy()
    assert proc.returncode == 0, output(proc)[-4000:]
    first = bakers(lab)
    baking = host_results(proc, "Bake JIT cache")
    assert {n: r for n, r in baking.items() if r != "Skipped"} == {
        b: "Success" for b in first.values()
    }, output(proc)[-3000:]
    restoring = host_results(proc, "Restore JIT cache")
    assert {r for r in restoring.values() if r != "Skipped"} == {"No changes"}, restoring
    assert {p.name: p.read_text() for p in lab.store.glob("*.json")} == before
    for baker in first.values():  # fetched, not baked again: one engine start in the log
        log = lab.bed.ssh(baker, f"cat {CACHE_ROOT}/.bake-{key}.log", check=True).stdout
        assert log.count("### hgxserve cache bake:") == 1, log[-2000:]


def test_restored_cache_starts_the_engine_without_jit(lab: Lab) -> None:
    """The fake engine on a host that only received the archive finds every kernel cached."""
    key = render_key(lab)
    host = lab.bed.names[-1]
    cache = f"{CACHE_ROOT}/{key}"
    log = f"/var/lib/hgxserve/run/{ENGINE_PREFIX}check.log"
    prompt = json.dumps({"model": "tiny", "prompt": list(range(1, 65)), "max_tokens": 16})
    script = f"""
set -u
mkdir -p /var/lib/hgxserve/run
VLLM_CACHE_ROOT={cache}/vllm TILELANG_CACHE_DIR={cache}/tilelang \\
  {FAKE_RUNTIME}/bin/vllm serve /models/tiny --served-model-name tiny --port {PORT} \\
  --max-model-len 256 > {log} 2>&1 &
pid=$!
for i in $(seq 100); do curl -sf http://127.0.0.1:{PORT}/health >/dev/null && break; sleep 0.1; done
curl -sf -H 'Content-Type: application/json' -d {shlex.quote(prompt)} \\
  http://127.0.0.1:{PORT}/v1/completions >/dev/null; rc=$?
kill $pid; wait $pid 2>/dev/null
cat {log}
echo "##curl $rc"
/opt/hgxserve/bin/hgxserve cache scan {log} >/dev/null; echo "##scan $?"
"""
    out = lab.bed.ssh(host, script, check=True).stdout
    assert "##curl 0" in out, out
    assert "Directly load the compiled graph(s)" in out, out
    assert "##scan 0" in out, out  # no JIT/compile line at start or on the warmed shape
