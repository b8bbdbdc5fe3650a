#!/usr/bin/env python3
"""FAKE engine for the cache tests: compiles nothing, but logs and caches like a JIT engine does.

Test equipment only. It speaks enough of the vLLM HTTP API for a bake (/health, /v1/models,
/v1/completions) and imitates JIT behaviour with the real libraries' log lines:

- at start, unless `$VLLM_CACHE_ROOT/torch_compile_cache/fake/graph.bin` exists, it logs
  vLLM's "Compiling a graph for dynamic shape takes ..." and writes that file (else logs the
  cache hit line);
- for each request shape (prompt length bucket, max_tokens) whose kernel file is missing from
  `$TILELANG_CACHE_DIR`, the first `--jit-requests` requests log TileLang's "TileLang begins to
  compile kernel ..." line; the last of them writes the kernel file. With `--jit-forever` the
  kernel is never written (JIT on every request).

    python3 fake_jit_engine.py --port 8123 --jit-requests 3 --start-seconds 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
COUNTS: dict[str, int] = {}


def log(msg: str) -> None:
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [fake_jit_engine] {msg}", flush=True)


def shape_name(prompt_len: int, max_tokens: int) -> str:
    bucket = 1
    while bucket < prompt_len:
        bucket *= 2
    return f"fake_gemm_m{bucket}_n{max_tokens}"


class Handler(BaseHTTPRequestHandler):
    args: argparse.Namespace

    def log_message(self, *_: object) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused(self) -> bool:
        """vLLM with VLLM_API_KEY set: every /v1 path needs `Authorization: Bearer <key>`."""
        key = os.environ.get("VLLM_API_KEY")
        if not key or not self.path.startswith("/v1"):
            return False
        if self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._send(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {})
        elif self._refused():
            return
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.args.served_model_name}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self._refused():
            return
        if self.path != "/v1/completions":
            self._send(404, {"error": "not found"})
            return
        prompt = body.get("prompt") or []
        n_prompt = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
        max_tokens = int(body.get("max_tokens") or 16)
        if n_prompt + max_tokens > self.args.max_model_len:
            self._send(400, {"error": {"message": "maximum context length exceeded"}})
            return
        kernel = shape_name(n_prompt, max_tokens)
        cache = os.environ.get("TILELANG_CACHE_DIR", "")
        kernel_file = os.path.join(cache, f"{kernel}.so")
        with LOCK:
            if not os.path.exists(kernel_file):
                COUNTS[kernel] = COUNTS.get(kernel, 0) + 1
                if COUNTS[kernel] <= self.args.jit_requests or self.args.jit_forever:
                    print(
                        "2026-01-06 13:45:54  [TileLang:tilelang.jit.kernel:INFO]: TileLang begins "
                        f"to compile kernel `{kernel}` with `out_idx=[-1]`",
                        flush=True,
                    )
                    time.sleep(self.args.compile_seconds)
                if COUNTS[kernel] >= self.args.jit_requests and not self.args.jit_forever:
                    with open(kernel_file, "wb") as fh:
                        fh.write(f"compiled {kernel}\n".encode() * 64)
        self._send(
            200,
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": self.args.served_model_name,
                "choices": [{"index": 0, "text": " x" * max_tokens, "finish_reason": "length"}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens},
            },
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="/models/fake")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="fake")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--jit-requests", type=int, default=2)
    parser.add_argument("--jit-forever", action="store_true")
    parser.add_argument("--compile-seconds", type=float, default=0.0)
    parser.add_argument("--start-seconds", type=float, default=0.2)
    args, _ = parser.parse_known_args()
    Handler.args = args
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root:
        graph = os.path.join(root, "torch_compile_cache", "fake", "graph.bin")
        if os.path.exists(graph):
            log(
                "Directly load the compiled graph(s) for dynamic shape from the cache, took 0.001 s"
            )
        else:
            os.makedirs(os.path.dirname(graph), exist_ok=True)
            time.sleep(args.start_seconds)
            with open(graph, "wb") as fh:
                fh.write(b"fake graph\n" * 100)
            log(f"Compiling a graph for dynamic shape takes {args.start_seconds:.2f} s")
    time.sleep(args.start_seconds)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True

    def stop(*_: object) -> None:
        log("SIGTERM: shutting down")
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    log(
        f"Application startup complete on {args.host}:{args.port}; "
        f"env HOME={os.environ.get('HOME')}"
    )
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
