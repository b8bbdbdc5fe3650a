"""The simulated engine behaves like the engines it stands in for (HTTP API, P/D, failures)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import SIMENGINE, SimEngine, free_port, http, http_json, metric, port_open, sse_events

from hgxserve.proxy.pd import PREFILL_KV_PARAMS

pytestmark = pytest.mark.timeout(60)

NIXL_P = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cuda"}'
NIXL_D = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cuda"}'


def vllm_args(*extra: str) -> list[str]:
    return ["serve", "/models/m", "--served-model-name", "m", "--max-model-len", "4096", *extra]


def complete(url: str, prompt: str, **body: object) -> tuple[int, dict]:
    return http_json("POST", url + "/v1/completions", {"model": "m", "prompt": prompt, **body})


def test_malformed_json_flag_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SIMENGINE),
            "--engine",
            "vllm",
            "serve",
            "/m",
            "--kv-transfer-config",
            "{kv_connector: Nixl",
        ],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert proc.returncode == 2
    assert "--kv-transfer-config" in proc.stderr and "invalid JSON" in proc.stderr


def test_start_delay_gpu_memory_and_clean_stop(tmp_path: Path) -> None:
    env = {
        "HGXSERVE_SIM_START_SECONDS": "1.0",
        "HGXSERVE_SIM_STOP_SECONDS": "0.8",
        "CUDA_VISIBLE_DEVICES": "4,5",
        "VLLM_PORT": "30000",
        "UCX_NET_DEVICES": "mlx5_0:1",
    }
    eng = SimEngine(
        "vllm",
        vllm_args(
            "--gpu-memory-utilization",
            "0.5",
            "--enforce-eager",
            "--some-future-flag",
            "7",
            "--tensor-parallel-size",
            "2",
        ),
        tmp_path,
        env=env,
        wait=False,
    )
    eng.start()
    try:
        time.sleep(0.5)
        assert not port_open("127.0.0.1", eng.port), "port must open only when ready, as vLLM"
        eng.wait_ready()
        assert http("GET", eng.url + "/health")[:2] == (200, b"")
        files = sorted(p.name for p in eng.gpu_dir.iterdir())
        assert files == ["4.json", "5.json"]
        held = json.loads((eng.gpu_dir / "4.json").read_text())
        assert held == {
            "pid": eng.pid,
            "used_mib": int(0.5 * 143771),
            "process_name": "VLLM::EngineCore",
        }
        log = eng.log()
        assert "SIMULATED vllm" in log and "--some-future-flag" in log
        assert '"VLLM_PORT": "30000"' in log and '"UCX_NET_DEVICES": "mlx5_0:1"' in log
        eng.terminate()
        time.sleep(0.4)
        assert not port_open("127.0.0.1", eng.port), "stops serving at once on SIGTERM"
        assert (eng.gpu_dir / "4.json").exists(), "GPU memory is released only after a while"
        assert eng.stop() == 0
        assert list(eng.gpu_dir.iterdir()) == []
    finally:
        eng.stop()


def test_models_health_metrics_and_deterministic_text(tmp_path: Path) -> None:
    with SimEngine("vllm", vllm_args(), tmp_path) as eng:
        status, models = http_json("GET", eng.url + "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "m"
        assert models["data"][0]["max_model_len"] == 4096
        a = complete(eng.url, "tell me about GPUs", temperature=0, max_tokens=20)[1]
        b = complete(eng.url, "tell me about GPUs", temperature=0, max_tokens=20)[1]
        assert a["choices"][0]["text"] == b["choices"][0]["text"] != ""
        assert a["usage"]["completion_tokens"] <= 20
        ok = complete(eng.url, "Only answer: PD_OK", temperature=0, max_tokens=32)[1]
        assert ok["choices"][0]["text"] == "PD_OK" and ok["choices"][0]["finish_reason"] == "stop"
        capped = complete(eng.url, "Only answer: PD_OK", max_tokens=4, ignore_eos=True)[1]
        assert capped["usage"]["completion_tokens"] == 4
        assert capped["choices"][0]["finish_reason"] == "length"
        assert complete(eng.url, "x", model="other")[0] == 404
        assert complete(eng.url, "x", max_tokens=5000)[0] == 400  # over max_model_len
        text = eng.metrics()
        assert metric(text, "vllm:request_success_total", model_name="m") == 4
        assert metric(text, "vllm:generation_tokens_total") > 0
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 4
        assert metric(text, "vllm:e2e_request_latency_seconds_count") == 4
        assert metric(text, "vllm:num_requests_running") == 0


def test_chat_streaming_reasoning_and_thinking_off(tmp_path: Path) -> None:
    with SimEngine("vllm", vllm_args("--reasoning-parser", "deepseek_r1"), tmp_path) as eng:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "只输出：PD_OK"}],
            "max_tokens": 64,
            "temperature": 0,
        }
        status, ans = http_json("POST", eng.url + "/v1/chat/completions", body)
        msg = ans["choices"][0]["message"]
        assert status == 200 and msg["content"] == "PD_OK" and msg["reasoning_content"]
        off = {**body, "chat_template_kwargs": {"thinking": False}}
        msg = http_json("POST", eng.url + "/v1/chat/completions", off)[1]["choices"][0]["message"]
        assert msg["content"] == "PD_OK" and msg["reasoning_content"] is None
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, raw, headers = http("POST", eng.url + "/v1/chat/completions", stream)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 1
        deltas = [e["choices"][0]["delta"] for e in events[:-2] if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas).startswith("Let me think")
        assert "".join(d.get("content") or "" for d in deltas) == "PD_OK"


def side_channel(port: int) -> dict[str, str]:
    """The environment of an engine whose NIXL side channel listens on 127.0.0.1:`port`."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def test_nixl_transfer_eos_and_tp_mismatch(tmp_path: Path) -> None:
    sc_p, sc_d = free_port(), free_port()
    tp2 = ("--tensor-parallel-size", "2", "--kv-transfer-config")
    with (
        SimEngine("vllm", vllm_args(*tp2, NIXL_P), tmp_path, env=side_channel(sc_p)) as pre,
        SimEngine("vllm", vllm_args(*tp2, NIXL_D), tmp_path, env=side_channel(sc_d)) as dec,
        SimEngine(
            "vllm",
            vllm_args(
                "--kv-transfer-config",
                NIXL_D.replace(
                    "}", ',"kv_connector_extra_config":{"kv_load_failure_policy":"fail"}}'
                ),
            ),
            tmp_path,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ) as dec_tp1,
    ):
        assert port_open("127.0.0.1", sc_p), "prefill listens on its NIXL side channel"
        ask = dict(PREFILL_KV_PARAMS)  # what the proxy sends a prefill
        prompt = "a long prompt " * 20
        status, first = complete(pre.url, prompt, max_tokens=1, kv_transfer_params=ask)
        params = first["kv_transfer_params"]
        assert status == 200 and params["do_remote_prefill"] is True
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == sc_p
        assert params["tp_size"] == 2 and len(params["remote_block_ids"]) >= 1
        status, ans = complete(dec.url, prompt, max_tokens=8, kv_transfer_params=params)
        assert status == 200 and ans["usage"]["completion_tokens"] == 8
        text = dec.metrics()
        assert metric(text, "vllm:nixl_xfer_time_seconds_count") == 2  # one per TP rank
        assert metric(text, "vllm:nixl_num_failed_transfers_total") == 0
        assert metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        # the blocks were handed out once: a second pull of the same blocks fails -> recompute
        assert complete(dec.url, prompt, max_tokens=2, kv_transfer_params=params)[0] == 200
        assert metric(dec.metrics(), "vllm:nixl_num_failed_transfers_total") == 1
        assert dec.requests()[-1]["kv"] == "recomputed"
        # first token EOS: the prefill returns no params
        eos = complete(pre.url, "FIRST_TOKEN_EOS please", max_tokens=1, kv_transfer_params=ask)[1]
        assert eos["kv_transfer_params"] is None and eos["choices"][0]["finish_reason"] == "stop"
        # decode TP 1 cannot read a TP 2 prefill's KV; with policy fail that is an error
        params = complete(pre.url, prompt, max_tokens=1, kv_transfer_params=ask)[1]
        status, err = complete(dec_tp1.url, prompt, kv_transfer_params=params["kv_transfer_params"])
        assert status == 500
        assert (
            "Local tensor parallel size 1 is not divisible by remote tensor parallel size 2"
            in err["error"]["message"]
        )


def test_side_channel_on_loopback_fails_across_hosts(tmp_path: Path) -> None:
    """Prefill on "host A" (127.0.0.2) advertises localhost: decode on B cannot reach it."""
    sc = free_port("127.0.0.2")
    host_a = {"HGXSERVE_SIM_LOOPBACK": "127.0.0.2", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(sc)}
    host_b = {"HGXSERVE_SIM_LOOPBACK": "127.0.0.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    ask = {"do_remote_decode": True}
    with (
        SimEngine("vllm", vllm_args("--kv-transfer-config", NIXL_P), tmp_path, env=host_a) as pre,
        SimEngine("vllm", vllm_args("--kv-transfer-config", NIXL_D), tmp_path, env=host_b) as dec,
    ):
        params = complete(pre.url, "hello", max_tokens=1, kv_transfer_params=ask)[1][
            "kv_transfer_params"
        ]
        assert params["remote_host"] == "localhost"
        status, _ = complete(dec.url, "hello", max_tokens=3, kv_transfer_params=params)
        assert status == 200, "default policy recompute: HTTP 200 that silently recomputed"
        text = dec.metrics()
        assert metric(text, "vllm:nixl_num_failed_transfers_total") == 1
        assert metric(text, "vllm:nixl_xfer_time_seconds_count") == 0
        assert "handshake_setup_failed" in dec.requests()[-1]["kv_error"]
    routable = {**host_a, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.2"}
    with (
        SimEngine("vllm", vllm_args("--kv-transfer-config", NIXL_P), tmp_path, env=routable) as pre,
        SimEngine("vllm", vllm_args("--kv-transfer-config", NIXL_D), tmp_path, env=host_b) as dec,
    ):
        params = complete(pre.url, "hello", max_tokens=1, kv_transfer_params=ask)[1][
            "kv_transfer_params"
        ]
        assert params["remote_host"] == "127.0.0.2"
        assert complete(dec.url, "hello", max_tokens=3, kv_transfer_params=params)[0] == 200
        assert metric(dec.metrics(), "vllm:nixl_xfer_time_seconds_count") == 1
        assert dec.requests()[-1]["kv"] == "transferred"


def test_sglang_pd_bootstrap_and_health_generation(tmp_path: Path) -> None:
    boot = free_port()
    common = ["serve", "--model-path", "/models/m", "--served-model-name", "m", "--tp", "1"]
    quiet = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    with (
        SimEngine(
            "sglang",
            [
                *common,
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(boot),
            ],
            tmp_path,
            env=quiet,
        ) as pre,
        SimEngine("sglang", [*common, "--disaggregation-mode", "decode"], tmp_path) as dec,
    ):
        body = {
            "model": "m",
            "prompt": "Only answer: PD_OK",
            "max_tokens": 16,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot,
            "bootstrap_room": 42,
        }
        import threading

        got: dict[str, object] = {}
        t = threading.Thread(
            target=lambda: got.update(d=http_json("POST", dec.url + "/v1/completions", body))
        )
        t.start()  # decode first: it waits for the prefill to hold room 42
        time.sleep(0.3)
        assert http_json("POST", pre.url + "/v1/completions", body)[0] == 200
        t.join(10)
        status, ans = got["d"]  # type: ignore[misc]
        assert status == 200 and ans["choices"][0]["text"] == "PD_OK"
        assert metric(dec.metrics(), "sglang:kv_transfer_latency_ms_count") == 1
        bad = {**body, "bootstrap_port": free_port(), "bootstrap_room": 7}
        assert http_json("POST", dec.url + "/v1/completions", bad)[0] == 500
        assert metric(dec.metrics(), "sglang:num_bootstrap_failed_reqs_total") == 1
        # /health: the decode (env unset, SGLang's default) generates, the prefill does not
        before_d = metric(dec.metrics(), "sglang:generation_tokens_total")
        before_p = metric(pre.metrics(), "sglang:generation_tokens_total")
        for _ in range(3):
            http("GET", dec.url + "/health")
            http("GET", pre.url + "/health")
        assert metric(dec.metrics(), "sglang:generation_tokens_total") == before_d + 3
        assert metric(pre.metrics(), "sglang:generation_tokens_total") == before_p


@pytest.mark.parametrize("mode", ["never_healthy", "crash_on_start", "exit_after:2", "garbage"])
def test_failure_injection(tmp_path: Path, mode: str) -> None:
    env = {"HGXSERVE_SIM_FAIL": mode, "CUDA_VISIBLE_DEVICES": "0"}
    eng = SimEngine("vllm", vllm_args(), tmp_path, env=env, wait=False)
    eng.start()
    try:
        if mode == "crash_on_start":
            assert eng.proc is not None and eng.proc.wait(10) == 1
            assert not (eng.gpu_dir / "0.json").exists()
            return
        eng.wait_ready()
        if mode == "never_healthy":
            for _ in range(3):
                assert http("GET", eng.url + "/health")[0] == 503
            assert complete(eng.url, "x")[0] == 503
        elif mode == "exit_after:2":
            assert complete(eng.url, "x", max_tokens=2)[0] == 200
            assert complete(eng.url, "x", max_tokens=2)[0] == 200
            assert eng.proc is not None and eng.proc.wait(5) == 1
            held = json.loads((eng.gpu_dir / "0.json").read_text())
            assert held["pid"] == eng.pid, "a dead engine leaves its memory file (pid is dead)"
        else:
            text = complete(eng.url, "Only answer: PD_OK", temperature=0)[1]["choices"][0]["text"]
            assert text != "PD_OK"
    finally:
        eng.stop()


def test_error_injection_prints_a_real_capture_that_the_diagnosis_names(tmp_path: Path) -> None:
    from hgxserve.parsers.outputs import diagnose_errors

    env = {"HGXSERVE_SIM_FAIL": "error:h200_error-802_hf-jobs", "HGXSERVE_SIM_START_SECONDS": "0"}
    proc = subprocess.run(
        [sys.executable, str(SIMENGINE), "--engine", "vllm", *vllm_args()],
        env={**env, "PATH": "/usr/bin:/bin", "HGXSERVE_SIM_GPU_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert "Error 802: system not yet initialized" in proc.stderr
    assert [d["code"] for d in diagnose_errors(proc.stdout + proc.stderr)] == ["cuda-802"]


def test_slow_stop_ignores_sigterm_for_a_while(tmp_path: Path) -> None:
    env = {"HGXSERVE_SIM_FAIL": "slow_stop", "HGXSERVE_SIM_SLOW_STOP_SECONDS": "1.5"}
    with SimEngine("vllm", vllm_args(), tmp_path, env=env) as eng:
        t0 = time.monotonic()
        eng.terminate()
        assert eng.proc is not None and eng.proc.wait(10) == 0
        assert time.monotonic() - t0 >= 1.5


def test_headless_holds_gpus_without_http(tmp_path: Path) -> None:
    port = free_port()
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    args = vllm_args(
        "--headless",
        "--data-parallel-size",
        "16",
        "--data-parallel-size-local",
        "8",
        "--data-parallel-start-rank",
        "8",
        "--port",
        str(port),
    )
    eng = SimEngine("vllm", args, tmp_path, env=env, wait=False, headless=True)
    eng.start()
    try:
        deadline = time.monotonic() + 10
        while len(list(eng.gpu_dir.glob("*.json"))) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(eng.gpu_dir.glob("*.json"))) == 8
        assert not port_open("127.0.0.1", port) and "headless" in eng.log()
        assert eng.stop() == 0
        assert list(eng.gpu_dir.glob("*.json")) == []
    finally:
        eng.stop()


def test_kv_capacity_reported_as_the_real_engines_do(tmp_path: Path) -> None:
    from hgxserve.release.kvcap import (
        read_capacity,
        sglang_log_capacity,
        vllm_log_capacity,
        vllm_metrics_capacity,
    )

    # default: max_num_seqs x max_model_len (256 x 4096), in vLLM's metrics and start log
    with SimEngine("vllm", vllm_args(), tmp_path) as eng:
        reading = vllm_metrics_capacity(eng.metrics())
        assert reading is not None and (reading.tokens, reading.block_size) == (256 * 4096, 16)
        log = eng.log_path.read_text()
        assert "GPU KV cache size: 1,048,576 tokens" in log
        assert "Maximum concurrency for 4,096 tokens per request: 256.00x" in log
        assert vllm_log_capacity(log).tokens == 256 * 4096  # type: ignore[union-attr]
    # a test makes it too small through the engine's environment
    small = {"HGXSERVE_SIM_KV_TOKENS": "128"}
    with SimEngine("vllm", vllm_args(), tmp_path, env=small) as eng:
        assert vllm_metrics_capacity(eng.metrics()).tokens == 128  # type: ignore[union-attr]
        reading = read_capacity(eng.url + "/health", eng.log_path.read_text())
        assert reading is not None and (reading.tokens, reading.source) == (128, "metrics")
    sglang = ["serve", "--model-path", "/models/m", "--context-length", "1024"]
    with SimEngine("sglang", sglang, tmp_path, env={"HGXSERVE_SIM_KV_TOKENS": "4000"}) as eng:
        assert sglang_log_capacity(eng.log_path.read_text()).tokens == 4000  # type: ignore[union-attr]
        status, info = http_json("GET", eng.url + "/get_server_info")
        assert status == 200 and info["max_total_num_tokens"] == 4000
        reading = read_capacity(eng.url + "/health", "")
        assert reading is not None and (reading.tokens, reading.source) == (4000, "server_info")
