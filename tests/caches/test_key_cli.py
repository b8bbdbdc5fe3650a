"""`hgxserve cache key|pack|restore|scan|state|bake` through the CLI: stable keys, clear errors."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.caches.hostfacts import KEY_FACTS, normalize_host_facts
from hgxserve.cli.caches import cache

REPO = Path(__file__).resolve().parents[2]
BASE = (REPO / "topologies" / "h20-v4flash-tp8.yml").read_text()
FAKE = os.path.join(os.path.dirname(__file__), "fake_jit_engine.py")

FACTS = {
    "engine_version": "0.26.0",
    "torch_version": "2.9.0+cu129",
    "cuda_version": "12.9",
    "driver_version": "570.158.01",
    "gpu_name": "NVIDIA H20",
    "sm_count": 78,
    "compute_capability": "9.0",
    "model_manifest_sha256": "a" * 64,
}
CHANGED = {
    "engine_version": "0.26.1",
    "torch_version": "2.9.1+cu129",
    "cuda_version": "13.0",
    "driver_version": "575.57.08",
    "gpu_name": "NVIDIA H200",
    "sm_count": 132,
    "compute_capability": "9.1",
    "model_manifest_sha256": "b" * 64,
}


def run(*args: str, ok: bool = True):
    result = CliRunner().invoke(cache, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def key_for(tmp_path, topo_text: str, facts: dict | None, name: str = "t") -> str:
    topo = tmp_path / f"{name}.yml"
    topo.write_text(topo_text)
    args = ["key", "--topology", str(topo), "--engine", "combined-0", "--host", "h20-a"]
    if facts is not None:
        fpath = tmp_path / f"{name}.facts.json"
        fpath.write_text(json.dumps(facts))
        args += ["--facts", str(fpath)]
    return run(*args).output.strip()


def test_documented_facts_cover_the_issue_inputs():
    assert set(FACTS) == set(KEY_FACTS) == set(CHANGED)


def test_same_inputs_give_same_key(tmp_path):
    first = key_for(tmp_path, BASE, FACTS, "a")
    assert first == key_for(tmp_path, BASE, dict(reversed(list(FACTS.items()))), "b")
    assert first.startswith("vllm-0.26.0-h20-")


@pytest.mark.parametrize("fact", sorted(CHANGED))
def test_each_host_fact_changes_the_key(tmp_path, fact):
    base = key_for(tmp_path, BASE, FACTS, "a")
    assert key_for(tmp_path, BASE, {**FACTS, fact: CHANGED[fact]}, "b") != base


def test_volatile_facts_do_not_change_the_key(tmp_path):
    noisy = {**FACTS, "memory_used_mib": 1234, "temperature": 41, "uuid": "GPU-1"}
    assert key_for(tmp_path, BASE, noisy, "b") == key_for(tmp_path, BASE, FACTS, "a")


def test_hgxserve_facts_output_is_accepted(tmp_path):
    nested = {"gpu": {"status": "ok", "driver_version": "570.158.01",
                      "gpus": [{"name": "NVIDIA H20", "memory_used_mib": 3}] * 8}}  # fmt: skip
    assert normalize_host_facts(nested) == {
        "driver_version": "570.158.01",
        "gpu_name": "NVIDIA H20",
    }
    flat = {"driver_version": "570.158.01", "gpu_name": "NVIDIA H20"}
    assert key_for(tmp_path, BASE, nested, "a") == key_for(tmp_path, BASE, flat, "b")


@pytest.mark.parametrize(
    "old,new",
    [
        ("version: 0.26.0", "version: 0.26.1"),  # engine version
        ("runtime: {venv: /opt/vllm-0.26,", "runtime: {venv: /opt/vllm-0.26b,"),
        ("gpu: H20", "gpu: H200"),  # GPU kind
        ("name: DeepSeek-V4-Flash-0731\n", "name: DeepSeek-V4-Flash-0801\n"),  # model
        ("    tp: 8", "    tp: 8\n    ep: true"),  # parallel layout
        ("max_model_len: 204800", "max_model_len: 131072"),  # compile-relevant arg
        ("max_num_seqs: 16", "max_num_seqs: 32"),  # CUDA graph sizes
        ("kv_cache_dtype: fp8", "kv_cache_dtype: auto"),
        (
            "distributed_executor_backend: mp",
            "distributed_executor_backend: mp\n  env: {VLLM_USE_DEEP_GEMM: 1}",
        ),
    ],  # fmt: skip
)
def test_each_render_input_changes_the_key(tmp_path, old, new):
    assert old in BASE
    changed = BASE.replace(old, new, 1)
    assert key_for(tmp_path, changed, FACTS, "b") != key_for(tmp_path, BASE, FACTS, "a")


@pytest.mark.parametrize(
    "old,new",
    [
        ("port: 8100", "port: 8101"),
        ("address: 10.0.0.11", "address: 10.0.0.12"),
        ("gpu_memory_utilization: 0.88", "gpu_memory_utilization: 0.9"),
    ],
)
def test_irrelevant_inputs_keep_the_key(tmp_path, old, new):
    assert old in BASE
    changed = BASE.replace(old, new, 1)
    assert key_for(tmp_path, changed, FACTS, "b") == key_for(tmp_path, BASE, FACTS, "a")


def test_key_json_shows_inputs_and_dir(tmp_path):
    topo = tmp_path / "t.yml"
    topo.write_text(BASE)
    out = json.loads(run("key", "--topology", str(topo), "--engine", "combined-0", "--json").output)
    assert out["dir"] == f"/var/cache/hgxserve/{out['render_key']}"
    assert out["inputs"]["host_facts"] == {}


def test_key_errors_are_clear(tmp_path):
    topo = tmp_path / "t.yml"
    topo.write_text(BASE)
    bad = run("key", "--topology", str(topo), "--engine", "nope", ok=False)
    assert bad.exit_code == 2 and "engine 'nope' is not in" in bad.output
    facts = tmp_path / "f.json"
    facts.write_text("{not json")
    bad = run(
        "key", "--topology", str(topo), "--engine", "combined-0", "--facts", str(facts), ok=False
    )
    assert bad.exit_code == 2 and "not JSON" in bad.output
    facts.write_text('{"sm_count": "many"}')
    bad = run(
        "key", "--topology", str(topo), "--engine", "combined-0", "--facts", str(facts), ok=False
    )
    assert "sm_count: 'many' is not an integer" in bad.output


def test_pack_restore_state_cli(tmp_path):
    src = tmp_path / "root" / "k"
    (src / "triton").mkdir(parents=True)
    (src / "triton" / "k.cubin").write_bytes(b"\x00" * 1000)
    packed = json.loads(run("pack", "--dir", str(src), "--out", str(tmp_path / "store")).output)
    assert os.path.basename(packed["archive"]) == f"{packed['sha256']}.tar.zst"
    dest = tmp_path / "host" / "k"
    args = ["restore", "--archive", packed["archive"], "--dir", str(dest), "--key", "full-1"]
    assert json.loads(run(*args).output)["changed"] is True
    assert json.loads(run(*args).output)["changed"] is False
    state = json.loads(run("state", "--root", str(tmp_path / "host")).output)
    assert state["k"]["archive_sha256"] == packed["sha256"]
    assert state["k"]["full_key"] == "full-1"
    # a different full key on the same dir restores again (e.g. after a driver change)
    args[-1] = "full-2"
    assert json.loads(run(*args).output)["changed"] is True


def test_restore_corrupt_archive_cli_is_one_clear_line(tmp_path):
    bad = tmp_path / ("0" * 64 + ".tar.zst")
    bad.write_bytes(b"garbage")
    result = run("restore", "--archive", str(bad), "--dir", str(tmp_path / "k"), ok=False)
    assert result.exit_code == 6
    assert "corrupt or truncated" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "k").exists()


def test_scan_cli_exit_codes(tmp_path):
    log = tmp_path / "log"
    log.write_text("INFO ready\n")
    assert run("scan", str(log)).output.strip() == "[]"
    log.write_text("x TileLang begins to compile kernel `k` with `out_idx=[-1]`\n")
    result = run("scan", str(log), ok=False)
    assert result.exit_code == 1 and "tilelang" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_bake_cli_runs_the_rendered_unit(tmp_path, monkeypatch):
    """The bake runs the renderer's argv/env: a fake `vllm` in a venv dir stands in for vLLM."""
    import hgxserve.base.paths as paths

    monkeypatch.setattr(paths, "RUN_ROOT", str(tmp_path / "run"))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    program = venv / "bin" / "vllm"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} --jit-requests 2 "$@"\n')
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    port = _free_port()
    text = (
        BASE.replace("runtime: {venv: /opt/vllm-0.26,", f"runtime: {{venv: {venv},")
        .replace("port: 8100", f"port: {port}")
        .replace("max_model_len: 204800", "max_model_len: 2048")
        .replace("{input: 4096, output: 128", "{input: 1024, output: 128")
        + f"cache: {{root: {tmp_path / 'cache'}}}\n"
    )
    topo = tmp_path / "t.yml"
    topo.write_text(text)
    facts = tmp_path / "f.json"
    facts.write_text(json.dumps(FACTS))
    # The topology keys its engines (proxy.auth.engine_api_key): the engine gets VLLM_API_KEY
    # from the credential its unit loads, and answers 401 to a warm-up without it.
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "hgxserve-engine-key").write_text("bake-engine-key-81d2\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    out = run(
        "bake", "--topology", str(topo), "--engine", "combined-0", "--facts", str(facts),
        "--pack-to", str(tmp_path / "store"), "--ready-timeout", "30",
    ).output  # fmt: skip
    assert "bake-engine-key-81d2" not in out
    summary = json.loads(out[out.index("{") :])
    assert summary["settled"] is True
    assert [r["jit_lines"] for r in summary["rounds"]][-1] == 0
    assert summary["rounds"][0]["jit_lines"] > 0
    key_dir = Path(summary["dir"])
    assert key_dir.parent == tmp_path / "cache"
    record = json.loads((key_dir / ".hgxserve-bake.json").read_text())
    assert record["argv"][0] == str(program) and record["argv"][1] == "serve"
    assert record["env"]["TILELANG_CACHE_DIR"] == str(key_dir / "tilelang")
    assert record["secret_env"] == {"VLLM_API_KEY": "hgxserve-engine-key"}
    assert all(r["failed"] == 0 for r in record["rounds"])
    logged = Path(record["log"]).read_text() + (key_dir / ".hgxserve-bake.json").read_text()
    assert "bake-engine-key-81d2" not in logged
    shapes = [(s["input"], s["output"], s["concurrency"]) for s in record["shapes"]]
    assert shapes == [(128, 64, 8), (1024, 128, 4), (2032, 16, 1)]
    marker = json.loads((key_dir / ".hgxserve-cache.json").read_text())
    assert marker["full_key"] == summary["full_key"]
    assert marker["archive_sha256"] == summary["archive"]["sha256"]
    assert (tmp_path / "store" / f"{marker['archive_sha256']}.tar.zst").is_file()
