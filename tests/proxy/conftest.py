"""Fixtures: simulated engines (tests/simengine/harness.py) and a real `hgxserve proxy serve`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simengine"))

from harness import SimEngine, free_port, http, port_open  # noqa: E402

from hgxserve.proxy.scrape import metrics_headers  # noqa: E402

HGXSERVE = Path(sys.executable).with_name("hgxserve")


class ProxyProcess:
    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "health": {"interval_s": 0.1, "timeout_s": 1},
            **config,
        }
        self.config_path = workdir / f"proxy-{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"proxy-{self.port}.log"
        self.log_file = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(HGXSERVE), "proxy", "serve", "--config", str(self.config_path)],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )

    def wait_routable(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"proxy exited: {self.log()}")
            if port_open("127.0.0.1", self.port) and http("GET", self.url + "/health")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"proxy not routable: {self.log()}")

    def wait_in_rotation(self, timeout: float = 15) -> None:
        """Until every instance has passed its first health probe (all in rotation).

        /health answers 200 as soon as one route is healthy; a test that kills an engine to see
        the proxy find it dead must first wait for this, or the first probe finds it dead.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                line.rsplit(" ", 1)[1]
                for line in self.metrics().splitlines()
                if line.startswith("hgxserve_proxy_instance_healthy{")
            ]
            if states and all(state == "1" for state in states):
                return
            time.sleep(0.05)
        raise AssertionError(f"not every instance came into rotation: {self.metrics()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        """/metrics, with the key its configuration names (as the host's readers send it)."""
        return http("GET", self.url + "/metrics", headers=metrics_headers(self.config_path))[
            1
        ].decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., SimEngine]]:
    started: list[SimEngine] = []

    def start(engine: str, args: list[str], **kw: Any) -> SimEngine:
        eng = SimEngine(engine, args, tmp_path, **kw)
        started.append(eng)
        eng.start()
        return eng

    yield start
    for eng in started:
        eng.stop()


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Callable[..., ProxyProcess]]:
    started: list[ProxyProcess] = []

    def start(config: dict[str, Any], wait: bool | str = True) -> ProxyProcess:
        """Start a proxy; by default return once every instance has passed its first health
        probe, so which route a request takes does not depend on how loaded the machine is.
        ``wait="routable"``: only until /health answers (one route healthy), for a proxy in
        front of an engine that is meant to be down; ``wait=False``: not at all."""
        p = ProxyProcess(config, tmp_path)
        started.append(p)
        if wait:
            p.wait_routable()
        if wait is True:
            p.wait_in_rotation()
        return p

    yield start
    for p in started:
        p.stop()


class SglangEngines:
    """Simulated SGLang engines serving /models/m as "m" (started through `engines`)."""

    def __init__(self, engines: Callable[..., SimEngine]) -> None:
        self.engines = engines

    def start(
        self, mode: str | None = None, *extra: str, bootstrap_port: int | None = None
    ) -> SimEngine:
        """One engine: `mode` "prefill" or "decode", None for combined; `extra` serve args."""
        args = ["serve", "--model-path", "/models/m", "--served-model-name", "m", *extra]
        if mode:
            args += ["--disaggregation-mode", mode]
        if bootstrap_port is not None:
            args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        return self.engines("sglang", args, env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"})

    def pd(self, *extra: str) -> tuple[SimEngine, SimEngine, dict[str, Any]]:
        """A prefill and a decode engine, and the proxy config of that one P/D group."""
        boot = free_port()
        pre = self.start("prefill", *extra, bootstrap_port=boot)
        dec = self.start("decode", *extra)
        group = {"prefill": [{"url": pre.url, "bootstrap_port": boot}], "decode": [dec.url]}
        return pre, dec, {"protocol": "sglang", "served_model_name": "m", "pd_groups": [group]}


@pytest.fixture
def sglang(engines: Callable[..., SimEngine]) -> SglangEngines:
    return SglangEngines(engines)
