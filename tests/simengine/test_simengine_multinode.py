"""The simulated engine's multi-node behaviour: the head serves only once its workers joined,
dies when one of them dies (as vLLM's head does), and a worker hangs when its head dies."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from harness import SimEngine, free_port, http, port_open

pytestmark = pytest.mark.timeout(60)


def head_args(rpc: int) -> list[str]:
    return ["serve", "/models/m", "--served-model-name", "m", "--data-parallel-size", "2",
            "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc)]  # fmt: skip


def worker_args(rpc: int) -> list[str]:
    return ["serve", "/models/m", "--headless", "--data-parallel-size", "2",
            "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
            "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc)]  # fmt: skip


def wait_for(check, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_head_waits_for_its_worker_and_dies_with_it(tmp_path: Path) -> None:
    rpc = free_port()
    with SimEngine("vllm", head_args(rpc), tmp_path, wait=False) as head:
        wait_for(lambda: "remote core engine proc(s) to start" in head.log())
        time.sleep(1.0)
        assert not port_open("127.0.0.1", head.port)  # no API before the worker joined
        with SimEngine("vllm", worker_args(rpc), tmp_path, wait=False, headless=True) as worker:
            head.wait_ready()
            assert http("GET", head.url + "/health")[0] == 200
            assert worker.proc is not None and head.proc is not None
            worker.proc.send_signal(signal.SIGKILL)
            assert head.proc.wait(timeout=15) == 1
        assert "EngineDeadError" in head.log() and "died unexpectedly" in head.log()


def test_a_worker_hangs_when_its_head_dies(tmp_path: Path) -> None:
    rpc = free_port()
    with (
        SimEngine("vllm", head_args(rpc), tmp_path, wait=False) as head,
        SimEngine("vllm", worker_args(rpc), tmp_path, wait=False, headless=True) as worker,
    ):
        head.wait_ready()
        assert head.proc is not None and worker.proc is not None
        head.proc.send_signal(signal.SIGKILL)
        wait_for(lambda: "lost the head" in worker.log())
        time.sleep(1.0)
        assert worker.proc.poll() is None  # still there, serving nothing


def test_an_sglang_head_waits_for_its_other_nodes(tmp_path: Path) -> None:
    rpc = free_port()
    node = ["serve", "--model-path", "/models/m", "--tp", "4", "--nnodes", "2",
            "--dist-init-addr", f"127.0.0.1:{rpc}"]  # fmt: skip
    with SimEngine("sglang", [*node, "--node-rank", "0"], tmp_path, wait=False) as head:
        wait_for(lambda: "remote core engine proc(s) to start" in head.log())
        assert not port_open("127.0.0.1", head.port)
        worker_argv = [*node, "--node-rank", "1"]
        with SimEngine("sglang", worker_argv, tmp_path, wait=False, headless=True) as worker:
            head.wait_ready()
            assert worker.proc is not None and head.proc is not None
            worker.proc.send_signal(signal.SIGKILL)
            assert head.proc.wait(timeout=15) == 1
