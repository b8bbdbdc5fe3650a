"""What the proxy and the engines say about themselves (/metrics), read around each round.

Engine figures are the engines' own counters, taken as the difference between a snapshot before
and after the round, so they cover exactly the round's window: prefill tokens/s per prefill GPU,
decode TPOT (mean, from the latency histograms), KV transfers (count, failures, mean time) and
the requests the engines finished.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from hgxserve.base.errors import ExitCode, HgxserveError, UsageError
from hgxserve.base.promtext import parse_samples
from hgxserve.topology import Topology, ports
from hgxserve.topology.model import is_loopback
from hgxserve.topology.ports import engine_bind, engine_url

PROXY_OUTSTANDING = "hgxserve_proxy_outstanding_requests"
# The engines' own names for the same facts (vLLM V1, SGLang).
RUNNING = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs"}
WAITING = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs"}
PROMPT_TOKENS = {"vllm": "vllm:prompt_tokens_total", "sglang": "sglang:prompt_tokens_total"}
GENERATION_TOKENS = {
    "vllm": "vllm:generation_tokens_total",
    "sglang": "sglang:generation_tokens_total",
}
FINISHED = {"vllm": "vllm:request_success_total", "sglang": "sglang:num_requests_total"}
TTFT = {"vllm": "vllm:time_to_first_token_seconds", "sglang": "sglang:time_to_first_token_seconds"}
E2E = {"vllm": "vllm:e2e_request_latency_seconds", "sglang": "sglang:e2e_request_latency_seconds"}
# vLLM: prompt tokens the engine computed itself (a decode that pulled KV computes none).
LOCAL_PROMPT = ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
KV_XFER = {"vllm": "vllm:nixl_xfer_time_seconds", "sglang": "sglang:kv_transfer_latency_ms"}
KV_FAILED = {
    "vllm": ("vllm:nixl_num_failed_transfers_total",),
    "sglang": ("sglang:num_transfer_failed_reqs_total", "sglang:num_bootstrap_failed_reqs_total"),
}

# vLLM NIXL (docs "NIXL KV Connector Metrics"): on the prefill, requests whose KV expired
NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
# The proxy's count of P/D requests by what the prefill handed over (hgxserve/proxy/metrics.py).
PROXY_HANDOFFS = "hgxserve_proxy_kv_handoffs_total"
# requests the proxy's KV-aware policy sent to a decode alone, to prefill locally because few of
# their prompt tokens were uncached there (docs/proxy.md "KV-aware routing")
PROXY_DECISIONS = "hgxserve_proxy_route_decisions_total"
PD_LOCAL = "pd-local"
# Speculative decoding: vLLM's counters (vllm/v1/spec_decode/metrics.py), SGLang's gauge of the
# mean accepted length per verify step.
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"


class MetricsError(HgxserveError):
    """An endpoint's /metrics could not be read."""

    exit_code = ExitCode.SOURCE


# A /metrics answer is read up to this size: a vLLM engine with every histogram of 8 DP ranks
# or a DCGM exporter of 8 GPUs writes well under 1 MiB.
METRICS_MAX_BYTES = 16 << 20


def fetch_text(url: str, timeout: float = 10.0, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as resp:
            body = resp.read(METRICS_MAX_BYTES + 1)
            if len(body) > METRICS_MAX_BYTES:
                raise MetricsError(f"{url}: more than {METRICS_MAX_BYTES} bytes")
            return str(body.decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        raise MetricsError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise MetricsError(f"{url}: cannot connect ({getattr(exc, 'reason', exc)})") from None


def total(text: str, name: str, match: dict[str, str] | None = None) -> float:
    """Sum of every sample called `name` whose labels include `match`."""
    match = match or {}
    return sum(
        v
        for n, labels, v in parse_samples(text)
        if n == name and all(labels.get(k) == want for k, want in match.items())
    )


@dataclass(frozen=True)
class EngineTarget:
    name: str
    role: str
    engine: str  # vllm | sglang
    url: str
    gpus: int


@dataclass(frozen=True)
class Targets:
    proxy_url: str
    engines: tuple[EngineTarget, ...]
    served_name: str = ""
    metrics_key: str | None = None  # the proxy's /metrics wants it (proxy.auth.metrics_key)

    @property
    def answering(self) -> list[EngineTarget]:
        """Engines that finish a client's request: decode and combined (a prefill hands off)."""
        return [e for e in self.engines if e.role != "prefill"]

    def gpus(self, role: str | None = None) -> int:
        return sum(e.gpus for e in self.engines if role is None or e.role == role)


def targets(
    topo: Topology, *, proxy_url: str | None = None, engine_urls: dict[str, str] | None = None
) -> Targets:
    """The proxy's URL and every engine's, as seen from the controller (the topology's
    addresses unless given, e.g. through an SSH tunnel)."""
    engine_urls = engine_urls or {}
    unknown = sorted(set(engine_urls) - set(topo.engines))
    if unknown:
        raise UsageError(
            f"--engine-url names no engine of the topology: {', '.join(unknown)} "
            f"(engines: {', '.join(topo.engines)})"
        )
    if topo.proxy is None:
        raise UsageError(f"{topo.source_file}: the topology has no proxy to bench through")
    proxy = topo.proxy
    if proxy_url is None:
        if is_loopback(proxy.listen_host):
            raise UsageError(
                f"the proxy listens on {proxy.listen_host} on {proxy.host}, which the controller "
                "cannot reach: pass --inventory with --from HOST, or --proxy-url through a tunnel"
            )
        proxy_url = ports.proxy_url(topo, None)  # from the controller, outside the topology
    hidden = [
        e.name
        for e in topo.engines.values()
        if e.name not in engine_urls and is_loopback(engine_bind(topo, e))
    ]
    if hidden:
        first = topo.engines[hidden[0]]
        raise UsageError(
            f"{', '.join(hidden)} listen(s) on loopback only ({first.head} fronts it with the "
            "proxy), so the controller cannot read its /metrics: pass --inventory (each engine "
            "is then read through its own host over SSH), or --engine-url "
            f"{first.name}=http://127.0.0.1:PORT through a tunnel, e.g. ssh -N -L "
            f"PORT:127.0.0.1:{first.port} {topo.hosts[first.head].address}"
        )
    engines = tuple(
        EngineTarget(
            e.name,
            e.role,
            e.engine,
            engine_urls.get(e.name, "").rstrip("/") or engine_url(topo, e, from_host=""),
            e.world_size,
        )
        for e in topo.engines.values()
    )
    return Targets(proxy_url.rstrip("/"), engines, topo.model.served_name)


@dataclass
class Snapshot:
    """/metrics of the proxy and every engine at one moment."""

    proxy: str
    engines: dict[str, str] = field(default_factory=dict)


def snapshot(t: Targets) -> Snapshot:
    snap = Snapshot(fetch_text(t.proxy_url + "/metrics", key=t.metrics_key))
    for e in t.engines:
        snap.engines[e.name] = fetch_text(e.url + "/metrics")
    return snap


def busy(t: Targets, snap: Snapshot) -> dict[str, float]:
    """Everything that is not idle: proxy outstanding requests, engines' running/waiting."""
    out: dict[str, float] = {}
    outstanding = total(snap.proxy, PROXY_OUTSTANDING)
    if outstanding:
        out["proxy outstanding"] = outstanding
    for e in t.engines:
        text = snap.engines[e.name]
        running = total(text, RUNNING[e.engine])
        waiting = total(text, WAITING[e.engine])
        if running:
            out[f"{e.name} running"] = running
        if waiting:
            out[f"{e.name} waiting"] = waiting
    return out


def _delta(before: str, after: str, name: str, match: dict[str, str] | None = None) -> float:
    return total(after, name, match) - total(before, name, match)


def engine_figures(t: Targets, before: Snapshot, after: Snapshot, seconds: float) -> dict:
    """Per-role figures of a round from the engines' own counters (after - before)."""
    seconds = max(seconds, 1e-9)
    out: dict[str, dict[str, float | None]] = {}
    finished = 0.0
    for e in t.engines:
        b, a = before.engines[e.name], after.engines[e.name]
        prompt = _delta(b, a, PROMPT_TOKENS[e.engine])
        if e.engine == "vllm" and total(a, LOCAL_PROMPT[0]):
            computed = _delta(b, a, *LOCAL_PROMPT)
        else:
            computed = prompt
        gen = _delta(b, a, GENERATION_TOKENS[e.engine])
        done = _delta(b, a, FINISHED[e.engine])
        count = _delta(b, a, E2E[e.engine] + "_count")
        e2e_sum = _delta(b, a, E2E[e.engine] + "_sum")
        ttft_sum = _delta(b, a, TTFT[e.engine] + "_sum")
        ttft_count = _delta(b, a, TTFT[e.engine] + "_count")
        tpot = None
        if e.role != "prefill" and gen - count > 0 and ttft_count:
            tpot = (e2e_sum - ttft_sum) / (gen - count) * 1000
        xfers = _delta(b, a, KV_XFER[e.engine] + "_count")
        xfer_sum = _delta(b, a, KV_XFER[e.engine] + "_sum")
        unit = 1000 if e.engine == "vllm" else 1  # SGLang's histogram is in ms already
        failed = sum(_delta(b, a, name) for name in KV_FAILED[e.engine])
        out[e.name] = {
            "role": e.role,  # type: ignore[dict-item]
            "gpus": e.gpus,
            "requests_finished": done,
            "prompt_tokens": prompt,
            "prompt_tokens_computed": computed,
            "generation_tokens": gen,
            "prefill_tok_s_per_gpu": computed / seconds / e.gpus if e.gpus else None,
            "output_tok_s_per_gpu": gen / seconds / e.gpus if e.gpus else None,
            "tpot_ms_mean": tpot,
            "kv_transfers": xfers,
            "kv_transfer_failures": failed,
            "kv_transfer_ms_mean": xfer_sum / xfers * unit if xfers else None,
            **spec_figures(e.engine, b, a),
        }
        if e.role != "prefill":
            finished += done
    roles: dict[str, dict[str, float | None]] = {}
    for role in sorted({e.role for e in t.engines}):
        members = [out[e.name] for e in t.engines if e.role == role]
        gpus = sum(float(m["gpus"] or 0) for m in members)
        computed = sum(float(m["prompt_tokens_computed"] or 0) for m in members)
        gen = sum(float(m["generation_tokens"] or 0) for m in members)
        tpots = [m["tpot_ms_mean"] for m in members if m["tpot_ms_mean"] is not None]
        roles[role] = {
            "gpus": gpus,
            "prefill_tok_s_per_gpu": computed / seconds / gpus if gpus else None,
            "output_tok_s_per_gpu": gen / seconds / gpus if gpus else None,
            "tpot_ms_mean": sum(tpots) / len(tpots) if tpots else None,
            "kv_transfers": sum(float(m["kv_transfers"] or 0) for m in members),
            "kv_transfer_failures": sum(float(m["kv_transfer_failures"] or 0) for m in members),
            "spec_acceptance_rate": _mean(members, "spec_acceptance_rate"),
            "spec_accept_length": _mean(members, "spec_accept_length"),
        }
    return {"engines": out, "roles": roles, "requests_finished": finished}


def _mean(members: list[dict[str, float | None]], key: str) -> float | None:
    values = [float(v) for m in members if (v := m.get(key)) is not None]
    return sum(values) / len(values) if values else None


def spec_figures(engine: str, before: str, after: str) -> dict[str, float | None]:
    """Speculative decoding over a round: vLLM's accepted / drafted tokens (acceptance rate, and
    mean accepted length 1 + accepted / drafts), SGLang's accept-length gauge after the round;
    None where the engine exports none (no speculative decoding)."""
    if engine == "sglang":
        present = any(n == SGLANG_ACCEPT_LENGTH for n, _, _ in parse_samples(after))
        length = total(after, SGLANG_ACCEPT_LENGTH) if present else None
        return {"spec_acceptance_rate": None, "spec_accept_length": length}
    if not any(n == SPEC_DRAFT_TOKENS for n, _, _ in parse_samples(after)):
        return {"spec_acceptance_rate": None, "spec_accept_length": None}
    accepted = _delta(before, after, SPEC_ACCEPTED)
    drafted = _delta(before, after, SPEC_DRAFT_TOKENS)
    drafts = _delta(before, after, SPEC_DRAFTS)
    return {
        "spec_acceptance_rate": accepted / drafted if drafted else None,
        "spec_accept_length": 1 + accepted / drafts if drafts else None,
    }


def kv_validity(t: Targets, before: Snapshot, after: Snapshot) -> dict[str, object]:
    """Whether every P/D request of a round had its KV moved (seed 003 §11.3: a decode that
    recomputed the prompt is no P/D evidence): no failed transfer on any engine (vLLM NIXL
    `nixl_num_failed_transfers`, SGLang `num_transfer_failed_reqs` / `num_bootstrap_failed_reqs`),
    no prompt the decode computed itself (vLLM `prompt_tokens_by_source{local_compute}` beyond
    the one token per request it may compute locally), no KV that expired on a vLLM prefill
    unpulled (`nixl_num_kv_expired_reqs`), no handoff the proxy counted as failed or without
    KV. Requests the proxy's KV-aware policy routed to a decode alone (`pd-local`) are counted
    apart, not as recomputed. `pd` is False for a topology without prefill engines (always
    valid)."""
    pd = any(e.role == "prefill" for e in t.engines)
    failed = sum(
        _delta(before.engines[e.name], after.engines[e.name], name)
        for e in t.engines
        for name in KV_FAILED[e.engine]
    )
    # vLLM's prefill counts requests whose KV expired before any decode pulled it
    expired = sum(
        _delta(before.engines[e.name], after.engines[e.name], NIXL_EXPIRED)
        for e in t.engines
        if e.engine == "vllm"
    )
    # a decode prefilling what the proxy routed to it alone (pd-local) is policy, not a lost
    # transfer: its local tokens then make no round INVALID by themselves (they are reported;
    # failed or expired transfers and failed handoffs still are)
    pd_local = _delta(before.proxy, after.proxy, PROXY_DECISIONS, {"route": PD_LOCAL})
    recomputed = 0.0
    for e in t.engines:
        b, a = before.engines[e.name], after.engines[e.name]
        if e.role == "decode" and e.engine == "vllm" and total(a, LOCAL_PROMPT[0]):
            done = _delta(b, a, FINISHED[e.engine])
            recomputed += max(0.0, _delta(b, a, *LOCAL_PROMPT) - done)
    handoffs = {
        r: _delta(before.proxy, after.proxy, PROXY_HANDOFFS, {"result": r})
        for r in ("ok", "none", "failed")
    }
    why = []
    if failed:
        why.append(f"{failed:g} failed KV transfer(s)")
    if expired:
        why.append(f"{expired:g} request(s) whose KV expired on the prefill unpulled")
    if recomputed and not pd_local:
        why.append(f"{recomputed:g} prompt tokens recomputed by the decode")
    if handoffs["failed"]:
        why.append(f"{handoffs['failed']:g} handoff(s) failed at the proxy")
    if handoffs["none"]:
        why.append(f"{handoffs['none']:g} handoff(s) without KV (the decode computed the prompt)")
    return {
        "pd": pd,
        "valid": not (pd and why),
        "failed_transfers": failed,
        "kv_expired": expired,
        "decode_recomputed_tokens": recomputed,
        "handoffs": handoffs,
        "pd_local_requests": pd_local,
        "why": why if pd else [],
    }


def engine_versions(t: Targets) -> dict[str, str]:
    """Each engine's own /version answer (vLLM); 'unknown' where it gives none."""
    out = {}
    for e in t.engines:
        try:
            body = json.loads(fetch_text(e.url + "/version", timeout=5))
            out[e.name] = f"{e.engine} {body.get('version', 'unknown')}"
        except (MetricsError, ValueError, AttributeError):
            out[e.name] = f"{e.engine} unknown"
    return out
