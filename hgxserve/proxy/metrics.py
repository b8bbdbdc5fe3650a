"""The proxy's counters and gauges, and its /metrics page (Prometheus text, docs/proxy.md
"Endpoints"; `hgxserve status` reads the instance families).

    metrics = Metrics()
    metrics.request("pd", "completions", 200)
    text = metrics.render(pool)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from hgxserve.base.promtext import Labels, family, histogram

if TYPE_CHECKING:
    from hgxserve.proxy.balancer import Instance, Pool

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ADDED_TTFT = "hgxserve_proxy_added_ttft_seconds"

# name, type, help, samples
Family = tuple[str, str, str, list[tuple[Labels, object]]]


K = TypeVar("K")


def _count(counts: dict[K, int], key: K) -> None:
    counts[key] = counts.get(key, 0) + 1


class Metrics:
    """Counters and histograms, rendered as Prometheus text."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.upstream_errors: dict[tuple[str, str, str], int] = {}
        self.retries = 0
        self.disconnects = 0
        self.stalled = 0  # clients cut because they stopped reading (client_write_timeout_s)
        self.started = time.time()
        # P/D KV hand-offs by result: ok (prefill returned the KV to pull / answered), none
        # (vLLM prefill returned no kv_transfer_params: decode computes the prompt itself),
        # failed (prefill failed)
        self.kv_handoffs: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.open_connections = 0
        self.in_flight = 0
        self.draining = 0  # 1 while paused or draining (new requests get 503 + Retry-After)
        self.buffered_body_bytes = 0
        self.added_ttft = [0] * (len(LATENCY_BUCKETS) + 1)
        self.added_sum = 0.0
        # more families appended to /metrics (the router's: hgxserve.proxy.kvroute)
        self.extra: Callable[[list[str]], None] | None = None

    def refuse(self, reason: str) -> None:
        _count(self.refused, reason)

    def request(self, route: str, endpoint: str, code: int) -> None:
        _count(self.requests, (route, endpoint, f"{code // 100}xx"))

    def upstream_error(self, inst: Instance, kind: str) -> None:
        _count(self.upstream_errors, (inst.role, inst.url, kind))

    def kv_handoff(self, result: str) -> None:
        _count(self.kv_handoffs, result)

    def observe_added_ttft(self, seconds: float) -> None:
        self.added_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.added_ttft[i] += 1
                return
        self.added_ttft[-1] += 1

    def render(self, pool: Pool) -> str:
        out: list[str] = []
        for name, kind, help_text, samples in self._route_families(pool):
            family(out, name, kind, help_text, samples)
        histogram(
            out,
            ADDED_TTFT,
            "Time to first byte spent in the proxy itself (total minus time waiting on engines).",
            LATENCY_BUCKETS,
            self.added_ttft,
            self.added_sum,
        )
        for name, kind, help_text, samples in self._door_families():
            family(out, name, kind, help_text, samples)
        if self.extra is not None:
            self.extra(out)
        return "\n".join(out) + "\n"

    def _route_families(self, pool: Pool) -> list[Family]:
        """Requests by route, engine failures, every instance's load and rotation state."""
        where = [({"role": i.role, "instance": i.url}, i) for i in pool.instances]
        requests = sorted(self.requests.items())
        errors = sorted(self.upstream_errors.items())
        return [
            (
                "hgxserve_proxy_requests_total",
                "counter",
                "Requests answered, by route and status class.",
                [({"route": r, "endpoint": e, "code": c}, n) for (r, e, c), n in requests],
            ),
            (
                "hgxserve_proxy_upstream_errors_total",
                "counter",
                "Upstream failures by instance.",
                [({"role": r, "instance": u, "kind": k}, n) for (r, u, k), n in errors],
            ),
            (
                "hgxserve_proxy_outstanding_requests",
                "gauge",
                "In-flight requests per instance.",
                [(w, i.outstanding) for w, i in where],
            ),
            (
                "hgxserve_proxy_instance_healthy",
                "gauge",
                "1 while the instance is in rotation.",
                [(w, int(i.healthy)) for w, i in where],
            ),
            (
                "hgxserve_proxy_instance_state_since_seconds",
                "gauge",
                "When the instance last went in or out of rotation (Unix time).",
                [(w, f"{i.since:.3f}") for w, i in where],
            ),
            (
                "hgxserve_proxy_instance_out_of_rotation",
                "gauge",
                "Instances out of rotation, with why.",
                [(w | {"reason": i.reason}, 1) for w, i in where if not i.healthy],
            ),
            (
                "hgxserve_proxy_kv_handoffs_total",
                "counter",
                "P/D requests by what the prefill handed to the decode: ok, none (no KV: decode "
                "computes the prompt), failed.",
                _by("result", self.kv_handoffs),
            ),
            (
                "hgxserve_proxy_start_time_seconds",
                "gauge",
                "When this proxy started (Unix time).",
                [({}, f"{self.started:.3f}")],
            ),
        ]

    def _door_families(self) -> list[Family]:
        """Retries, disconnects and what the front door holds and turned away."""
        scalars = [
            (
                "hgxserve_proxy_retries_total",
                "counter",
                "Upstream attempts retried on another instance.",
                self.retries,
            ),
            (
                "hgxserve_proxy_client_disconnects_total",
                "counter",
                "Clients that went away before their answer was complete.",
                self.disconnects,
            ),
            (
                "hgxserve_proxy_client_stalled_total",
                "counter",
                "Clients cut because they stopped reading their streamed answer.",
                self.stalled,
            ),
            (
                "hgxserve_proxy_open_connections",
                "gauge",
                "Client connections open now.",
                self.open_connections,
            ),
            (
                "hgxserve_proxy_in_flight_requests",
                "gauge",
                "Client requests being answered now.",
                self.in_flight,
            ),
            (
                "hgxserve_proxy_draining",
                "gauge",
                "1 while the proxy is paused or draining: new requests get 503 + Retry-After.",
                self.draining,
            ),
            (
                "hgxserve_proxy_buffered_body_bytes",
                "gauge",
                "Request body bytes held in memory now (bounded by the front door's budget).",
                self.buffered_body_bytes,
            ),
        ]
        families: list[Family] = [(n, k, h, [({}, v)]) for n, k, h, v in scalars]
        families.append(
            (
                "hgxserve_proxy_refused_total",
                "counter",
                "Requests and connections turned away at the front door, by reason.",
                _by("reason", self.refused),
            )
        )
        return families


def _by(label: str, counts: dict[str, int]) -> list[tuple[Labels, object]]:
    """One sample per key of `counts`, in key order, labelled `label`."""
    return [({label: key}, n) for key, n in sorted(counts.items())]
