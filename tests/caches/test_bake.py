"""Bake against a fake JIT engine on 127.0.0.1: warm until quiet, stop, record; restore → no JIT."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

import pytest

from hgxserve.base.cachelayout import BAKE_RECORD, cache_env
from hgxserve.caches.archive import pack_dir, restore_archive
from hgxserve.caches.bake import BakeError, BakeSpec, bake, deep_gemm_argv
from hgxserve.caches.logscan import scan
from hgxserve.caches.warmup import Shape, warmup_plan

FAKE = os.path.join(os.path.dirname(__file__), "fake_jit_engine.py")
pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec_for(root, key, *extra, engine="vllm", argv=None, max_rounds=6):
    port = free_port()
    env = cache_env(str(root), key)
    argv = argv or [sys.executable, FAKE, "--port", str(port), "--max-model-len", "512"]
    shapes = warmup_plan([Shape(64, 8, 2), Shape(300, 8, 1)], max_model_len=512)
    return BakeSpec(
        argv=[*argv, *extra],
        env=env,
        cache_dir=os.path.join(str(root), key),
        base_url=f"http://127.0.0.1:{port}",
        shapes=shapes,
        engine=engine,
        key=key,
        max_rounds=max_rounds,
        settle_seconds=0.2,
        ready_timeout=30,
        stop_timeout=10,
    ), port


def read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_plan_adds_near_max_shape():
    plan = warmup_plan([Shape(64, 8, 2), Shape(300, 8, 1)], max_model_len=512)
    assert [(s.input, s.output, s.concurrency) for s in plan] == [
        (64, 8, 2),
        (300, 8, 1),
        (496, 16, 1),
    ]
    assert plan[-1].label == "near-max"


def test_bake_warms_until_no_jit_lines(tmp_path):
    spec, _ = spec_for(tmp_path, "k1", "--jit-requests", "3")
    record = bake(spec)
    jit = [r["jit_lines"] for r in record["rounds"]]
    # 3 JIT requests per shape: shapes of concurrency 1 need 3 rounds, the 4th is quiet
    assert jit[:-1] and all(n > 0 for n in jit[:-1]) and jit[-1] == 0
    assert len(jit) == 4 and record["settled"] is True
    assert record["startup_jit_lines"] == 1  # the torch.compile line before ready
    assert all(r["failed"] == 0 for r in record["rounds"])
    kernels = sorted(os.listdir(tmp_path / "k1" / "tilelang"))
    assert kernels == ["fake_gemm_m512_n16.so", "fake_gemm_m512_n8.so", "fake_gemm_m64_n8.so"]
    on_disk = json.loads((tmp_path / "k1" / BAKE_RECORD).read_text())
    assert on_disk["rounds"] == record["rounds"]
    assert record["stop"]["sigkill"] is False
    assert not pid_alive(record["stop"]["pid"])
    # the engine saw the unit's env and nothing of the test runner's
    assert "HOME=None" in read(record["log"])


def test_bake_stops_after_max_rounds_when_jit_never_ends(tmp_path):
    spec, _ = spec_for(tmp_path, "k2", "--jit-forever", max_rounds=2)
    record = bake(spec)
    assert record["settled"] is False
    assert [r["round"] for r in record["rounds"]] == [1, 2]
    assert all(r["jit_lines"] == 4 for r in record["rounds"])  # 2 + 1 + 1 requests
    assert not pid_alive(record["stop"]["pid"])


def test_restored_cache_starts_without_jit(tmp_path):
    spec, _ = spec_for(tmp_path / "bake-host", "k3", "--jit-requests", "2")
    assert bake(spec)["settled"]
    packed = pack_dir(spec.cache_dir, str(tmp_path / "store") + "/")
    other = tmp_path / "other-host"
    restore_archive(packed.path, str(other / "k3"))
    again, _ = spec_for(other, "k3", "--jit-requests", "2")
    record = bake(again)
    assert record["startup_jit_lines"] == 0
    assert [r["jit_lines"] for r in record["rounds"]] == [0]
    assert "Directly load the compiled graph" in read(record["log"])


def test_engine_that_dies_before_ready_is_a_clear_error(tmp_path):
    spec, _ = spec_for(
        tmp_path, "k4", argv=[sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    )
    with pytest.raises(BakeError, match=r"exited with 3 before ready(.|\n)*boom"):
        bake(spec)


def test_sglang_runs_compile_deep_gemm_with_server_args_first(tmp_path):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    python = venv / "python"
    python.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        'echo "DeepGEMM JIT Compiling for <GEMM_NT_F8F8BF16> N=1, K=1, num_groups=1"\n'
    )
    sglang = venv / "sglang"
    sglang.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} {FAKE} "$@"\n')
    for f in (python, sglang):
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    port = free_port()
    argv = [str(sglang), "serve", "--model-path", "/models/m", "--port", str(port), "--tp", "1"]
    spec, _ = spec_for(tmp_path, "k5", engine="sglang", argv=argv)
    spec.base_url = f"http://127.0.0.1:{port}"
    record = bake(spec)
    assert calls.read_text().split() == [
        "-m", "sglang.compile_deep_gemm", "--model-path", "/models/m", "--port", str(port),
        "--tp", "1",
    ]  # fmt: skip
    assert record["compile_deep_gemm"]["argv"][0] == str(python)
    log = read(record["log"])
    assert log.index("compile_deep_gemm") < log.index("Application startup complete")


def test_deep_gemm_argv_refuses_unknown_program():
    with pytest.raises(BakeError, match="no-deep-gemm"):
        deep_gemm_argv(["/usr/bin/podman", "run", "img"])


@pytest.mark.parametrize(
    "line,source",
    [
        (
            "(EngineCore_DP0 pid=164) INFO 01-23 15:49:22 [backends.py:218] Compiling a graph "
            "for dynamic shape takes 10.00 s",
            "vllm",
        ),
        ("INFO 10-18 09:54:33 [monitor.py:34] torch.compile takes 21.97 s in total", "vllm"),
        (
            "[2025-06-08] Entering DeepGEMM JIT Pre-Compile session. It may take a long time",
            "deep_gemm",
        ),
        (
            "Try DeepGEMM JIT Compiling for <GEMM_NT_F8F8BF16> N=4096, K=7168, num_groups=1",
            "deep_gemm",
        ),
        (
            "2026-03-19 10:14:52  [TileLang:tilelang.jit.kernel:INFO]: TileLang begins to compile "
            "kernel `mha_decode_split` with `out_idx=[-1]`",
            "tilelang",
        ),
        ("2025-06-08 21:06:35,733 - INFO - flashinfer.jit: Loading JIT ops: cascade", "flashinfer"),
    ],
)
def test_real_jit_lines_are_recognised(line, source):
    assert [h.source for h in scan(line)] == [source]


def test_ordinary_lines_are_not_jit():
    text = (
        "INFO 01-23 15:49:41 [gpu_worker.py:298] Available KV cache memory: 1.2 GiB\n"
        'INFO: 127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK\n'
        "Directly load the compiled graph(s) for dynamic shape from the cache, took 0.5 s\n"
    )
    assert scan(text) == []


KEY_VALUE = "engine-key-5f3a9c"


def _keyed(tmp_path, monkeypatch, secret_source):
    """A bake of an engine keyed as its unit keys it: VLLM_API_KEY from a credential."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    spec, _ = spec_for(tmp_path, "keyed", "--jit-requests", "1")
    spec.secret_env = {"VLLM_API_KEY": secret_source}
    return spec


def test_keyed_engine_bakes_with_its_key_from_the_credential(tmp_path, monkeypatch):
    cred = tmp_path / "hgxserve-engine-key"
    cred.write_text(KEY_VALUE + "\n")
    spec = _keyed(tmp_path, monkeypatch, f"hgxserve-engine-key:{cred}")
    spec.api_key_var = "VLLM_API_KEY"
    record = bake(spec)
    assert record["settled"] is True
    assert all(r["failed"] == 0 for r in record["rounds"]) and record["rounds"][0]["requests"]
    # the key reached the engine (it refused key-less requests) and nothing wrote it down
    assert record["secret_env"] == {"VLLM_API_KEY": f"hgxserve-engine-key:{cred}"}
    written = read(os.path.join(spec.cache_dir, BAKE_RECORD)) + read(record["log"])
    assert KEY_VALUE not in written and KEY_VALUE not in json.dumps(record)


def test_keyed_engine_without_the_key_in_the_warmup_fails_the_bake(tmp_path, monkeypatch):
    # what a bake that starts the keyed engine but sends no key gets: 401 on every shape
    cred = tmp_path / "hgxserve-engine-key"
    cred.write_text(KEY_VALUE)
    spec = _keyed(tmp_path, monkeypatch, f"hgxserve-engine-key:{cred}")
    spec.model = "fake"  # as `cache bake` names it from the topology: the warm-up itself fails
    with pytest.raises(BakeError, match="HTTP 401"):
        bake(spec)


def test_missing_credential_is_named_before_the_engine_starts(tmp_path, monkeypatch):
    spec = _keyed(tmp_path, monkeypatch, f"hgxserve-engine-key:{tmp_path / 'absent'}")
    spec.api_key_var = "VLLM_API_KEY"
    with pytest.raises(BakeError, match="VLLM_API_KEY for the engine: credential "):
        bake(spec)
    assert not os.path.exists(os.path.join(spec.cache_dir, BAKE_RECORD))


def test_rendered_unit_names_the_engine_key_credential_never_its_value():
    from hgxserve.render import render_host
    from hgxserve.topology import load_topology

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    topo = load_topology(os.path.join(repo, "topologies/demo/demo-pd.yml"))
    decode = next(u for u in render_host(topo, "hgx-b").units if u.engine == "decode-0")
    assert decode.secret_env == {"VLLM_API_KEY": "hgxserve-engine-key"}
    assert "VLLM_API_KEY" not in decode.env


@pytest.mark.skipif(os.geteuid() != 0, reason="starting an engine as another user needs root")
def test_bake_runs_the_engine_as_the_units_user_and_hands_it_the_cache(tmp_path_factory):
    """As the deploy bakes (root, `--user hgxserve-engine`): the engine process runs as that
    user with its home, and the cache it warmed is that user's to write afterwards."""
    import pwd
    import tempfile

    user = pwd.getpwnam("nobody")
    # a root the user can reach (pytest's tmp dirs are root's 0700)
    root = tempfile.mkdtemp(prefix="hgxserve-bake-user-", dir="/var/tmp")
    os.chmod(root, 0o755)
    try:
        python = "/usr/bin/python3"  # the test runner's own may be under root's 0700 home
        spec, _ = spec_for(root, "k9", argv=None)
        spec.argv = [python, *spec.argv[1:]]
        spec.user = "nobody"
        record = bake(spec)
        assert record["user"] == "nobody" and record["settled"] is True
        # the fake engine logs its HOME; a unit with User= gets the user's from passwd
        assert f"HOME={user.pw_dir}" in read(record["log"])
        kernels = os.path.join(root, "k9", "tilelang")
        assert os.listdir(kernels)  # written by the engine, as nobody
        for folder, dirs, files in os.walk(os.path.join(root, "k9")):
            for name in [".", *dirs, *files]:
                assert os.lstat(os.path.join(folder, name)).st_uid == user.pw_uid, name
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="handing directories to another user needs root")
def test_a_link_the_engine_user_planted_hands_nothing_of_root_over():
    """The bake makes the unit's directories as the unit does: a directory of the engine user's
    swapped for a link to a root-owned folder (standing for /opt/hgxserve/bin) stays root's."""
    import shutil
    import tempfile

    from hgxserve.caches.bake import RunAs, ensure_cache_dirs

    base = tempfile.mkdtemp(prefix="hgxserve-bake-link-", dir="/var/tmp")
    os.chmod(base, 0o755)
    try:
        victim = os.path.join(base, "opt-bin")
        os.mkdir(victim)
        with open(os.path.join(victim, "hgxserve"), "w") as fh:
            fh.write("#!/bin/sh\n")
        env = {**cache_env(os.path.join(base, "cache"), "k1"), "TMPDIR": f"{base}/run/e/tmp"}
        run_as = RunAs.named("nobody")
        ensure_cache_dirs(env, run_as)
        for planted in (env["TMPDIR"], env["TRITON_CACHE_DIR"]):
            os.rmdir(planted)
            os.symlink(victim, planted)
            os.lchown(planted, run_as.uid, run_as.gid)
        ensure_cache_dirs(env, run_as)
        assert os.stat(victim).st_uid == 0 and stat.S_IMODE(os.stat(victim).st_mode) == 0o755
        assert os.stat(os.path.join(victim, "hgxserve")).st_uid == 0
        assert os.stat(os.path.join(base, "run", "e")).st_uid == run_as.uid
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_deep_gemm_argv_of_a_keyed_sglang_engine_leaves_the_key_launcher_out():
    from hgxserve.base.enginekey import keyed_sglang_command

    argv = keyed_sglang_command("/opt/sg/bin/python", ["/opt/sg/bin/sglang", "serve", "--tp", "8"])
    assert deep_gemm_argv(argv) == [
        "/opt/sg/bin/python", "-m", "sglang.compile_deep_gemm", "--tp", "8"
    ]  # fmt: skip
