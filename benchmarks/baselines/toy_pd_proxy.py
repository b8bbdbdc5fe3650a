"""Benchmark baseline: an equivalent of vLLM's example P/D proxy (`toy_proxy_server.py`).

Not product code and not vLLM's file: a minimal re-implementation with the same architecture, so
the proxy benchmark can compare against what the seeds ran in front of P/D engines:

- FastAPI app served by uvicorn (uvloop + httptools when installed, as `vllm[...]` installs them);
- one long-lived `httpx.AsyncClient` per prefill and per decode instance, picked round-robin;
- prefill: the request body with `stream=false`, `max_tokens=1`, `max_completion_tokens=1`, no
  `stream_options`/`min_tokens`, plus `kv_transfer_params={"do_remote_decode": true, ...}`, parsed
  with `response.json()`;
- decode: the original body plus the prefill's `kv_transfer_params`, streamed back to the client
  through a `StreamingResponse` (`aiter_bytes`), the same `X-Request-Id` on both hops.

Needs fastapi, httpx and uvicorn (a scratch venv, see benchmarks/bench_proxy.py):

    /tmp/toyproxy/venv/bin/python benchmarks/baselines/toy_pd_proxy.py --port 8300 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def build_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    """The proxy app: prefill (one token, KV kept for a remote decode), then streamed decode."""
    clients: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients["prefill"] = itertools.cycle(
            [httpx.AsyncClient(base_url=u, timeout=None, limits=unbounded) for u in prefill_urls]
        )
        clients["decode"] = itertools.cycle(
            [httpx.AsyncClient(base_url=u, timeout=None, limits=unbounded) for u in decode_urls]
        )
        yield  # the process exits after serving; its sockets close with it

    app = FastAPI(lifespan=lifespan)

    async def handle(request: Request, path: str) -> StreamingResponse:
        body = await request.json()
        req_id = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        headers = {"X-Request-Id": req_id}
        prefill_body = dict(body)
        prefill_body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        prefill_body["stream"] = False
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)
        prefill = next(clients["prefill"])
        resp = await prefill.post(path, json=prefill_body, headers=headers)
        resp.raise_for_status()
        params = resp.json().get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params
        decode = next(clients["decode"])

        async def relay() -> AsyncIterator[bytes]:
            async with decode.stream("POST", path, json=body, headers=headers) as up:
                up.raise_for_status()
                async for chunk in up.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> StreamingResponse:
        return await handle(request, "/v1/chat/completions")

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", nargs="+", required=True)
    ap.add_argument("--decode", nargs="+", required=True)
    args = ap.parse_args()
    # log_level warning: no access-log lines, as for the other proxies in the benchmark
    uvicorn.run(
        build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
