"""The round's tag: a pass-through on 127.0.0.1 that gives every request a round-unique id.

The load generator sends a random X-Request-Id of its own; this relay replaces it with
`<round id>-<n>` before the request reaches the proxy (which forwards X-Request-Id to the
engines), so a round's requests can be told apart in every log and a leftover client's cannot
pass for them (seed 003 §11.4). It also counts what the round really sent. Bytes are relayed
as they arrive (SSE unbuffered); its own cost is measured in benchmarks/bench_bench.py.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 §7.6.1) and those aiohttp sets itself.
_SKIP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "x-request-id",
    "authorization",
}


# What the load generator sends (AIPerf's chat and completions endpoints, and the model list).
RELAYED = frozenset(
    {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")}
)


@dataclass
class RelayCounts:
    sent: int = 0
    answered: int = 0
    failed: int = 0


class RoundRelay:
    """Run in a thread: `with RoundRelay(upstream, prefix) as relay: use relay.url`."""

    def __init__(self, upstream: str, prefix: str, api_key: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.prefix = prefix
        # the proxy's key is added here, so it is never on the generator's command line
        self._api_key = api_key
        self.counts = RelayCounts()
        self._serial = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._session: aiohttp.ClientSession | None = None

    def new_round(self, prefix: str) -> None:
        self.prefix = prefix
        self.counts = RelayCounts()
        self._serial = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if (request.method, request.path) not in RELAYED:
            # The relay adds the proxy's key: it forwards only what the generator sends, not
            # whatever another local process asks of the proxy (or its engines) in its name.
            return web.json_response(
                {"error": {"message": f"bench relay: {request.method} {request.path} is not "
                           "a load generator request; not forwarded", "code": 403}},
                status=403,
            )  # fmt: skip
        generation = request.method == "POST"  # GET /v1/models reaches no engine
        if generation:
            self.counts.sent += 1
        self._serial += 1
        req_id = f"{self.prefix}-{self._serial:07d}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        headers["X-Request-Id"] = req_id
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = await request.read()
        assert self._session is not None
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers
            ) as upstream:
                out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP}
                out_headers["X-Request-Id"] = req_id
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                if generation and upstream.status < 400:
                    self.counts.answered += 1
                elif generation:
                    self.counts.failed += 1
                return response
        except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            self.counts.failed += 1
            return web.json_response(
                {"error": {"message": f"bench relay: {exc}", "code": 502}}, status=502
            )

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await self._session.close()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to the caller by __enter__
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    def __enter__(self) -> RoundRelay:
        self._thread = threading.Thread(target=self._run, name="bench-relay", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or not self.url:
            raise RuntimeError(f"bench relay did not start: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)
