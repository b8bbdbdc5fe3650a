"""The render-time cache key: stable, and it changes with each input that affects compilation."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import ROOT, topology

from hgxserve.base.cachelayout import valid_key
from hgxserve.caches.key import cache_key
from hgxserve.topology.model import Runtime


@pytest.fixture
def base():
    topo = topology("h20-v4flash-4p4d.yml")
    return topo, topo.engines["decode-0"]


def test_key_is_stable_and_a_valid_directory_name(base):
    topo, engine = base
    key = cache_key(topo, engine)
    assert key == cache_key(topology("h20-v4flash-4p4d.yml"), engine)
    assert key.startswith("vllm-0.26.0-h20-") and valid_key(key)
    # and across processes (no hash randomisation, no dict-order effects)
    code = (
        "from hgxserve.topology import load_topology; from hgxserve.caches.key import cache_key;"
        "t=load_topology('topologies/h20-v4flash-4p4d.yml');"
        "print(cache_key(t, t.engines['decode-0']))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == key


def test_prefill_and_decode_with_equal_settings_share_a_key(base):
    topo, engine = base
    assert cache_key(topo, topo.engines["prefill-0"]) == cache_key(topo, engine)


@pytest.mark.parametrize(
    "change",
    [
        {"version": "0.26.1"},
        {"engine": "sglang"},
        {"runtime": Runtime(venv="/opt/vllm-other")},
        {"tp": 8},
        {"dp": 2},
        {"ep": True},
        {"extra_args": ("--enable-dbo",)},
    ],
    ids=lambda c: next(iter(c)),
)
def test_key_changes_with_each_engine_input(base, change):
    topo, engine = base
    assert cache_key(topo, replace(engine, **change)) != cache_key(topo, engine)


@pytest.mark.parametrize(
    "arg,value",
    [("kv_cache_dtype", "auto"), ("block_size", 64), ("max_num_seqs", 8), ("enforce_eager", False),
     ("speculative_config", {"method": "mtp"}), ("attention_backend", "FLASHMLA")],
)  # fmt: skip
def test_key_changes_with_compile_args(base, arg, value):
    topo, engine = base
    changed = replace(engine, args={**engine.args, arg: value})
    assert cache_key(topo, changed) != cache_key(topo, engine)


def test_key_ignores_ports_gpus_role_and_non_compile_env(base):
    topo, engine = base
    same = replace(
        engine,
        port=9999,
        place={"h20-a": (0, 1, 2, 3)},
        role="prefill",
        env={**engine.env, "VLLM_NIXL_SIDE_CHANNEL_PORT": "1", "NCCL_DEBUG": "INFO"},
        args={**engine.args, "gpu_memory_utilization": 0.5},
    )
    assert cache_key(topo, same) == cache_key(topo, engine)
    compile_env = replace(engine, env={**engine.env, "VLLM_USE_DEEP_GEMM": "0"})
    assert cache_key(topo, compile_env) != cache_key(topo, engine)


def test_key_changes_with_gpu_kind_model_and_host_facts(base):
    topo, engine = base
    h200 = replace(topo, hosts={"h20-a": replace(topo.hosts["h20-a"], gpu="H200")})
    assert cache_key(h200, engine) != cache_key(topo, engine)
    other_model = replace(topo, model=replace(topo.model, path="/models/other"))
    assert cache_key(other_model, engine) != cache_key(topo, engine)
    facts = {"driver": "570.158.01", "torch": "2.11", "cuda": "12.9", "sm_count": 78}
    assert cache_key(topo, engine, facts) != cache_key(topo, engine)
    assert cache_key(topo, engine, facts) == cache_key(topo, engine, dict(reversed(facts.items())))
    assert cache_key(topo, engine, {**facts, "driver": "575.1"}) != cache_key(topo, engine, facts)
