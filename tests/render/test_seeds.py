"""The rendered commands match the seeds' working commands flag for flag.

Each test takes the command line as the seed prints it, and the rendered argv, and compares
them as (flag, value) pairs; every difference is listed in the test with its reason.
"""

from __future__ import annotations

import json

from conftest import flag_pairs, seed_argv, topology

from hgxserve.render import render_host


def unit(topo, host, engine):
    return next(u for u in render_host(topo, host).units if u.engine == engine)


SEED003_TP8 = r"""vllm serve /workspace/model/DeepSeek-V4-Flash-0731 \
  --served-model-name DeepSeek-V4-Flash \
  --host 0.0.0.0 \
  --port 8000 \
  --trust-remote-code \
  --tensor-parallel-size 8 \
  --kv-cache-dtype fp8 \
  --block-size 256 \
  --gpu-memory-utilization 0.88 \
  --max-model-len 204800 \
  --tokenizer-mode deepseek_v4 \
  --tool-call-parser deepseek_v4 \
  --enable-auto-tool-choice \
  --reasoning-parser deepseek_v4 \
  --enable-prefix-caching \
  --speculative-config \
    '{"method":"dspark","num_speculative_tokens":5,"draft_sample_method":"greedy"}'"""


def test_seed003_tp8_combined():
    u = unit(topology("h20-v4flash-tp8.yml"), "h20-a", "combined-0")
    assert u.argv[:3] == ["/opt/vllm-0.26/bin/vllm", "serve", "/models/DeepSeek-V4-Flash-0731"]
    ours = set(flag_pairs(u.argv))
    seed = set(flag_pairs(seed_argv(SEED003_TP8)))
    # the topology runs target-only first, as seed 003 §5 advises, and puts a proxy on :8000
    # in front of the engine (so the engine binds loopback on 8100)
    assert seed - ours == {
        ("--host", "0.0.0.0"),
        ("--port", "8000"),
        ("--speculative-config", seed_argv(SEED003_TP8)[-1]),
    }
    assert ours - seed == {
        ("--host", "127.0.0.1"),
        ("--port", "8100"),
        ("--max-num-seqs", "16"),  # seed 003 §5: "explicitly set --max-num-seqs"
        ("--distributed-executor-backend", "mp"),  # seed 003 §11.3
        # the proxy routes it with policy kv-events (the default): the engine publishes
        ("--kv-events-config", KV_EVENTS.format(port=28100, replay="127.0.0.1:29100")),
    }
    assert u.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


KV_EVENTS = (
    '{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{port}",'
    '"replay_endpoint":"tcp://{replay}","topic":"kv-events"}}'
)


PD_COMMON = [
    "--dtype", "auto", "--served-model-name", "DeepSeek-V4-Flash", "--kv-cache-dtype", "fp8",
    "--block-size", "256", "--gpu-memory-utilization", "0.88", "--max-model-len", "204800",
    "--max-num-seqs", "16", "--tokenizer-mode", "deepseek_v4", "--tool-call-parser",
    "deepseek_v4", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4",
    "--reasoning-config",
    '{"reasoning_parser":"deepseek_v4","reasoning_start_str":"<think>","reasoning_end_str":"</think>"}',
    "--default-chat-template-kwargs", '{"thinking":true}', "--enable-prompt-tokens-details",
    "--enable-prefix-caching", "--trust-remote-code", "--enforce-eager",
]  # fmt: skip


def test_seed003_pd_prefill_and_decode():
    topo = topology("h20-v4flash-4p4d.yml")
    cases = {
        "prefill-0": ("8100", "kv_producer", "0,1,2,3", "20000", "5559"),
        "decode-0": ("8200", "kv_consumer", "4,5,6,7", "30000", "5659"),
    }
    port_offset = 20000  # KV events: the engine's port + 20000, replay + 21000, beside the API
    for name, (port, role, gpus, vllm_port, side_port) in cases.items():
        u = unit(topo, "h20-a", name)
        seed = [
            *PD_COMMON, "--host", "127.0.0.1", "--port", port, "--tensor-parallel-size", "4",
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"' + role + '","kv_buffer_device":"cuda"}',
        ]  # fmt: skip
        ours = flag_pairs(u.argv)
        assert set(flag_pairs(seed)) - set(ours) == set()
        events = KV_EVENTS.format(
            port=int(port) + port_offset, replay=f"127.0.0.1:{int(port) + port_offset + 1000}"
        )
        assert set(ours) - set(flag_pairs(seed)) == {
            ("--distributed-executor-backend", "mp"),
            ("--kv-events-config", events),
        }
        # the env of seed 003 §9.2, exactly
        for var, value in {
            "CUDA_VISIBLE_DEVICES": gpus,
            "VLLM_PORT": vllm_port,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": side_port,
            "UCX_NET_DEVICES": "all",
        }.items():
            assert u.env[var] == value, var
        # extra_args come last, in order, after the typed args
        assert tuple(u.argv[-5:]) == topo.engines[name].extra_args == tuple(PD_COMMON[-8:-3])


SEED003_SGLANG = r"""sglang serve \
  --trust-remote-code \
  --model-path /models/DeepSeek-V4-Flash-0731 \
  --served-model-name deepseek-v4-flash-sglang \
  --tp 8 \
  --moe-runner-backend marlin \
  --speculative-algorithm DSPARK \
  --mem-fraction-static 0.82 \
  --chunked-prefill-size 4096 \
  --swa-full-tokens-ratio 0.1 \
  --reasoning-parser deepseek-v4 \
  --tool-call-parser deepseekv4 \
  --host 0.0.0.0 \
  --port 30000"""


def test_seed003_sglang_tp8():
    u = unit(topology("seed003-sglang-tp8.yml"), "h20-a", "server-0")
    assert u.argv[:2] == ["/opt/sglang-0.5.17/bin/sglang", "serve"]
    ours = set(flag_pairs(u.argv))
    seed = set(flag_pairs(seed_argv(SEED003_SGLANG)))
    assert seed - ours == set()
    assert ours - seed == {("--max-running-requests", "16")}
    assert u.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert "VLLM_PORT" not in u.env


SEED002_SGLANG_DP8 = r"""python3 -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3.2 \
--host 0.0.0.0 --port 8000 \
--chat-template ./tool_chat_template_deepseekv32.jinja \
--tp-size 8 \
--enable-dp-attention \
--dp 8 \
--reasoning-parser deepseek-v3 \
--tool-call-parser deepseekv32"""

ALIASES = {"--tp-size": "--tp", "--dp-size": "--dp"}


def test_seed002_sglang_dp_attention():
    u = unit(topology("seed002-sglang-dp8.yml"), "h200-a", "server-0")
    seed = {(ALIASES.get(f, f), v) for f, v in flag_pairs(seed_argv(SEED002_SGLANG_DP8))}
    ours = set(flag_pairs(u.argv))
    # the seed loads from the hub and a relative template; hgxserve serves from the local copy
    assert seed - ours == {
        ("--model-path", "deepseek-ai/DeepSeek-V3.2"),
        ("--chat-template", "./tool_chat_template_deepseekv32.jinja"),
        ("-m", "sglang.launch_server"),
    }
    assert ours - seed == {
        ("--model-path", "/models/DeepSeek-V3.2"),
        ("--served-model-name", "deepseek-ai/DeepSeek-V3.2"),
        ("--chat-template", "/etc/hgxserve/files/tool_chat_template_deepseekv32.jinja"),
        ("--max-running-requests", "64"),
    }


SEED002_VLLM_DP8 = r"""vllm serve deepseek-ai/DeepSeek-V3.2 --tokenizer-mode deepseek_v32 \
--reasoning-parser deepseek_v3 \
-tp 1 -dp 8 --enable-expert-parallel --max-model-len 81920"""


def test_seed002_vllm_dp8_expert_parallel():
    u = unit(topology("seed002-vllm-dp8-ep.yml"), "h200-a", "server-0")
    short = {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size"}
    seed = {(short.get(f, f), v) for f, v in flag_pairs(seed_argv(SEED002_VLLM_DP8))}
    ours = set(flag_pairs(u.argv))
    assert seed - ours == set()
    assert ours - seed == {
        ("--served-model-name", "deepseek-ai/DeepSeek-V3.2"),
        ("--host", "0.0.0.0"),
        ("--port", "8000"),
        # not in args: the largest warmup concurrency, and the unit says so
        ("--max-num-seqs", "32"),
        ("--distributed-executor-backend", "mp"),
    }
    assert "# max-num-seqs 32: not set in args; the largest warmup concurrency" in u.content


def test_seed000_multinode_prefill_head_and_worker():
    topo = topology("seed000-2p1d-multinode.yml")
    head = unit(topo, "h200-a", "prefill-0")
    worker = unit(topo, "h200-b", "prefill-0")
    head_flags, worker_flags = dict(flag_pairs(head.argv)), dict(flag_pairs(worker.argv))
    common = {
        "--tensor-parallel-size": "2",
        "--data-parallel-size": "8",
        "--data-parallel-size-local": "4",
        "--data-parallel-address": "10.0.1.11",
        "--data-parallel-rpc-port": "13345",
        "--enable-expert-parallel": None,
        "--no-disable-nccl-for-dp-synchronization": None,  # seed 000 §4.4.1
        "--enable-eplb": None,
    }
    for flags in (head_flags, worker_flags):
        for flag, value in common.items():
            assert flags[flag] == value, flag
        # multi-node engines are not forced onto mp (vLLM picks its DP launcher)
        assert "--distributed-executor-backend" not in flags
        kv = json.loads(flags["--kv-transfer-config"])
        assert kv == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "kv_buffer_device": "cuda",
            "kv_load_failure_policy": "recompute",
        }
    assert head_flags["--host"] == "0.0.0.0" and head_flags["--port"] == "8100"
    assert "--headless" not in head_flags and "--data-parallel-start-rank" not in head_flags
    assert "--headless" in worker_flags and worker_flags["--data-parallel-start-rank"] == "4"
    assert "--host" not in worker_flags and "--port" not in worker_flags
    # same base port on both hosts: vLLM adds the DP rank (4..7 on the worker)
    assert head.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == worker.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert head.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.10.11"
    assert worker.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.10.12"
    assert "ports 5604-5607 on this host" in worker.content
    assert (head.node_rank, worker.node_rank, worker.nnodes) == (0, 1, 2)
    assert head.env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert head.env["UCX_TLS"] == "rc,cuda_copy"
