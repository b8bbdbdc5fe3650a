"""One call to one engine: send a request, wait within its time limits, and pass the answer to
the client byte for byte (SSE chunks as they arrive, JSON bodies untouched).

    relay = Relay(upstream, metrics, config.limits)
    resp = await relay.relay(call, decode, payload, waited=0.0)    # the client's answer
    status, data = await relay.prefill(call, prefill, payload)     # a prefill, read whole

A failure before any byte reached the client raises `UpstreamUnavailable`, so the caller may
try another engine; after that the stream ends with an SSE error event. Cancelling a call (the
client went away) closes its engine connections, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Coroutine, Iterator
from typing import Any

from aiohttp import web

from hgxserve.base.compat import timeout
from hgxserve.proxy.balancer import Instance
from hgxserve.proxy.config import Limits
from hgxserve.proxy.frontdoor import Call, answer_whole, error_response
from hgxserve.proxy.metrics import Metrics
from hgxserve.proxy.upstream import Response, Upstream, UpstreamError

log = logging.getLogger("hgxserve.proxy")

RETRYABLE_STATUS = (502, 503, 504)


class ClientStalled(ConnectionError):
    """A client that stopped reading its streamed answer was cut."""


class UpstreamUnavailable(Exception):
    """An instance failed before any byte reached the client: safe to try another one.

    `engine_down`: no connection could be made, so the instance leaves rotation for everyone
    (the health checks readmit it). A timeout or a dropped request only concerns this request.
    """

    def __init__(self, inst: Instance, why: str, cause: BaseException | None = None) -> None:
        super().__init__(why)
        self.inst = inst
        self.engine_down = isinstance(cause, UpstreamError) and cause.connect_failed
        self.timed_out = isinstance(cause, TimeoutError)


def error_kind(exc: BaseException) -> str:
    return exc.kind if isinstance(exc, UpstreamError) else type(exc).__name__


class Relay:
    """Calls to engines over the pooled `Upstream` client, counted in `Metrics`."""

    def __init__(self, upstream: Upstream, metrics: Metrics, limits: Limits) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.limits = limits

    def unavailable(
        self, inst: Instance, what: str, exc: TimeoutError | UpstreamError
    ) -> UpstreamUnavailable:
        """Count a failed call to `inst` and say so: `what: <the error>`."""
        self.metrics.upstream_error(inst, error_kind(exc))
        return UpstreamUnavailable(inst, f"{what}: {exc!r}", exc)

    def refused_key(self, inst: Instance) -> web.Response:
        """An engine answered 401 to the proxy: a deployment fault, not the client's."""
        self.metrics.upstream_error(inst, "http_401")
        log.warning(
            "%s %s refused the proxy's engine key (auth.upstream_api_key_file)", inst.role, inst.url
        )
        return error_response(
            502, f"The {inst.role} engine refused the proxy's credentials.", "bad_gateway"
        )

    async def prefill(self, call: Call, inst: Instance, payload: bytes) -> tuple[int, bytes]:
        """POST `payload` to a prefill engine and read its whole answer within
        `prefill_timeout_s`: (status, body). A prefill that cannot be reached, times out or
        breaks off counts as a failed KV hand-off and raises UpstreamUnavailable.
        """
        inst.outstanding += 1
        inst.picked += 1
        try:
            up = await self.upstream.post(
                inst.url,
                call.path,
                payload,
                call.req_id,
                total_timeout=self.limits.prefill_timeout_s,
            )
            try:
                data = await up.read()
            finally:
                up.release()
        except (TimeoutError, UpstreamError) as exc:
            self.metrics.kv_handoff("failed")
            raise self.unavailable(inst, "prefill unreachable", exc) from exc
        finally:
            inst.outstanding -= 1
        return up.status, data

    async def relay(
        self,
        call: Call,
        inst: Instance,
        payload: bytes,
        waited: float,
        watch: asyncio.Task[int] | None = None,
    ) -> web.StreamResponse:
        """Send `payload` (JSON) to the engine whose answer the client gets; pass the answer on.
        `waited`: seconds already spent on a prefill before this engine was asked; `watch`: a
        prefill running beside it, whose failure ends the wait for this engine's headers.

        Raises UpstreamUnavailable only while nothing has been sent to the client.
        """
        inst.outstanding += 1
        inst.picked += 1
        t_send = time.perf_counter()
        # the proxy's own share of the time to first byte: all but the engines' time
        added = max(0.0, t_send - waited - call.started)
        send = self.upstream.post(
            inst.url, call.path, payload, call.req_id, read_timeout=self.limits.read_timeout_s
        )
        try:
            try:
                # (the post awaited directly when nothing runs beside it: one frame less)
                up = await (send if watch is None else self._headers(send, watch))
            except (TimeoutError, UpstreamError) as exc:
                raise self.unavailable(inst, "unreachable", exc) from exc
            try:
                return await self._answer(call, inst, up, added)
            finally:
                up.release()
        finally:
            inst.outstanding -= 1

    async def _answer(
        self, call: Call, inst: Instance, up: Response, added: float
    ) -> web.StreamResponse:
        """The client's answer from the engine's: streamed, or read whole and passed on."""
        if up.status in RETRYABLE_STATUS:
            self.metrics.upstream_error(inst, f"http_{up.status}")
            raise UpstreamUnavailable(inst, f"answered HTTP {up.status}")
        if up.status == 401:
            return self.refused_key(inst)
        ctype = up.headers.get("content-type", "application/json")
        if call.stream and up.status == 200:
            return await self._stream(call, inst, up, ctype, added)
        try:
            data = await up.read()
        except (TimeoutError, UpstreamError) as exc:
            raise self.unavailable(inst, "answer cut off", exc) from exc
        self.metrics.observe_added_ttft(added)
        return answer_whole(call, up.status, ctype, data)

    async def _headers(
        self, post: Coroutine[Any, Any, Response], watch: asyncio.Task[int]
    ) -> Response:
        """Wait for the upstream's response headers; give up early if the watched prefill fails."""
        send = asyncio.ensure_future(post)
        try:
            done, _ = await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
            if send not in done and watch.exception() is not None:
                exc = watch.exception()
                assert isinstance(exc, UpstreamUnavailable)
                raise exc
            return await send
        finally:
            if not send.done():
                send.cancel()
                with contextlib.suppress(BaseException):
                    (await send).release()

    async def _write(self, request: web.BaseRequest, out: web.StreamResponse, data: bytes) -> None:
        """Write to the client; one that stopped reading (its socket buffer full for
        `client_write_timeout_s`) is cut: ClientStalled ends the request, which releases its
        in-flight slot and closes the engine's connection (the engine aborts the request).

        Every write that could wait is bounded, whatever its size: only one that cannot
        (nothing waiting to go out, and small enough that what the socket does not take stays
        under the transport's high-water mark, so the transport is not paused) skips the
        timer. A large write with nothing waiting before it used to skip it too, and when the
        socket was full its wait for the drain was unbounded."""
        transport = request.transport
        if (
            transport is None
            or not transport.get_write_buffer_size()
            and len(data) <= transport.get_write_buffer_limits()[1] // 2
        ):
            await out.write(data)  # this write does not wait
            return
        await self._bounded(request, out.write(data))

    async def _bounded(self, request: web.BaseRequest, write: Awaitable[None]) -> None:
        """Await a write to the client within `client_write_timeout_s`; past it the client is
        cut (ClientStalled, counted in hgxserve_proxy_client_stalled_total)."""
        try:
            async with timeout(self.limits.client_write_timeout_s):
                await write
        except TimeoutError:
            self.metrics.stalled += 1
            if request.transport is not None:
                request.transport.abort()
            raise ClientStalled(
                f"client stopped reading for {self.limits.client_write_timeout_s:g}s"
            ) from None

    async def _end(self, request: web.BaseRequest, out: web.StreamResponse) -> None:
        """End the stream (its last chunk, then a wait for the drain), bounded like a write."""
        transport = request.transport
        if transport is None or not transport.get_write_buffer_size():
            await out.write_eof()  # a few bytes, nothing waiting: this does not wait
            return
        await self._bounded(request, out.write_eof())

    async def _stream(
        self, call: Call, inst: Instance, up: Response, ctype: str, added: float
    ) -> web.StreamResponse:
        request = call.request
        out = web.StreamResponse(
            status=200,
            headers={"Content-Type": ctype, "Cache-Control": "no-cache", **call.id_headers()},
        )
        first = True
        try:
            async for chunk in up.chunks():
                if first:
                    await out.prepare(request)
                    self.metrics.observe_added_ttft(added)
                    first = False
                await self._write(request, out, chunk)
        except (TimeoutError, UpstreamError) as exc:
            # (a client that went away while we wrote to it raises ConnectionError: not here)
            if first:
                raise self.unavailable(inst, "stream failed before a byte", exc) from exc
            self.metrics.upstream_error(inst, error_kind(exc))
            # bytes already reached the client: never retried; say so in the stream
            log.warning("request %s: %s %s broke mid-stream: %r",
                        call.req_id, inst.role, inst.url, exc)  # fmt: skip
            err = {
                "error": {
                    "message": f"upstream {inst.role} failed mid-stream",
                    "type": "upstream_error",
                    "code": 502,
                }
            }
            with _client_gone():
                await self._write(request, out, b"data: " + json.dumps(err).encode() + b"\n\n")
        if first:
            await out.prepare(request)
        with _client_gone():
            await self._end(request, out)
        return out


@contextlib.contextmanager
def _client_gone() -> Iterator[None]:
    """A client that went away at the end of its stream is no error; one cut for stalling
    still ends the request (ClientStalled)."""
    try:
        yield
    except ClientStalled:
        raise
    except ConnectionError:
        pass
