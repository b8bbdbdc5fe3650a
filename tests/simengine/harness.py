"""Start and stop the simulated engine (testbed/simengine.py) on 127.0.0.1 for tests.

with SimEngine("vllm", ["serve", "/m", "--served-model-name", "m"], tmp_path) as eng:
    status, body = http_json("GET", eng.url + "/v1/models")
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SIMENGINE = Path(__file__).resolve().parents[2] / "testbed" / "simengine.py"


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and not one this process was handed before: the kernel
    may give the same free port to two binds in a row, and an engine's HTTP port and its side
    channel port asked for back to back then collide (`address already in use`)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def http_json(method: str, url: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
    status, raw, _ = http(method, url, body, **kw)
    return status, (json.loads(raw) if raw else None)


def sse_events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        mname = head.split("{", 1)[0]
        if mname != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"metric {name} {labels} not found"
    return total


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class SimEngine:
    """One simulated engine process, stopped by PID when the block ends."""

    def __init__(
        self,
        engine: str,
        args: list[str],
        workdir: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
        wait: bool = True,
        headless: bool = False,
    ) -> None:
        self.engine = engine
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        if not headless and "--port" not in self.args:
            self.args += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.workdir = workdir
        self.gpu_dir = workdir / "gpus"
        self.env = {
            **os.environ,
            "HGXSERVE_SIM_START_SECONDS": "0.2",
            "HGXSERVE_SIM_STOP_SECONDS": "0.2",
            "HGXSERVE_SIM_TOKEN_SECONDS": "0.001",
            "HGXSERVE_SIM_GPU_DIR": str(self.gpu_dir),
            **(env or {}),
        }
        self.log_path = workdir / f"sim-{engine}-{self.port}.log"
        self.wait = wait
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SimEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_file = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(SIMENGINE), "--engine", self.engine, *self.args],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        if self.wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"simulated engine exited {self.proc.returncode}: {self.log()}"
                )
            if port_open("127.0.0.1", self.port):
                return
            time.sleep(0.05)
        raise AssertionError(f"simulated engine not ready: {self.log()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode

    def metrics(self) -> str:
        return http("GET", self.url + "/metrics")[1].decode()

    def requests(self) -> list[dict[str, Any]]:
        return http_json("GET", self.url + "/sim/requests")[1]["requests"]
