"""The topology-wide health gate, run on the proxy's host after every host switched.

A green `/health` is not enough (seed 003 §11.3-11.4: HTTP 200 and both engines busy while
decode silently recomputed every prompt; §11.3 a Ray executor answered 200 with garbage). The
gate checks, in order: the proxy's /health, /v1/models names the served model, every engine is
in the proxy's rotation, a completion at temperature 0 returns the same non-empty text twice,
the topology's probe (`gate:` prompt) answers the expected text through chat and through the
streaming path (at the prompt lengths that reach the combined engines and P/D), a reasoning and
a tool-call probe when the engines parse them, and for P/D that the KV really moved: vLLM's
decode pulled it over NIXL (transfer count grew, no transfer failed), SGLang's decode saw no
failed bootstrap or transfer and its prefill served the P/D requests. That the bytes crossed
the hosts over RDMA, not a TCP fallback, is checked around the gate by the deploy (the hosts'
port counters, `hgxserve.release.evidence`).
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.apikeys import KeyFileError, read_key_file
from hgxserve.base.errors import Found
from hgxserve.base.promtext import parse_samples

# vLLM's NIXL connector metrics (KV transfer evidence on the decode side).
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
XFER_FAILED = "vllm:nixl_num_failed_transfers_total"
XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
# vLLM's prompt tokens by where the decode got them (vllm/v1/metrics/stats.py PromptTokenStats):
# P/D prompts must come from `external_kv_transfer`, not `local_compute`.
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# SGLang's disaggregation metrics (sglang/srt/metrics/collector.py): failures on either side, and
# the prefill's request count (the prefill must have served the P/D probes).
SGL_FAILED = ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total")
SGL_REQUESTS = "sglang:num_requests_total"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_PROMPT = "What is the weather in Paris right now? Call the get_weather tool."
NO_THINKING = {"thinking": False, "enable_thinking": False}


class GateError(Found):
    """The gate failed; the message says which check and why (exit 1: the check said no)."""


@dataclass
class GateSpec:
    proxy_url: str
    served_name: str
    api_key_file: str | None = None
    # the proxy's /metrics key (proxy.auth.metrics_key), where the gate's host holds it
    metrics_key_file: str | None = None
    pd_engine: str | None = None  # vllm when the topology has vLLM P/D routes
    decode_metrics: list[str] = field(default_factory=list)
    # what carried cross-host KV when the deploy does not check RDMA counters (gate.rdma: off),
    # said next to the NIXL evidence (hgxserve.release.evidence.unchecked_transport)
    kv_transport: str | None = None
    prefill_metrics: list[str] = field(default_factory=list)
    prompt_words: int = 64  # long enough to pass the proxy's prompt-length bucket
    timeout_s: float = 120.0
    instances_timeout_s: float = 60.0  # for the proxy's own health checks to admit every engine
    probe: dict[str, Any] = field(default_factory=dict)  # prompt, expect, expect_regex, max_tokens
    lengths: list[str] = field(default_factory=lambda: ["short"])  # short: combined, long: P/D
    chat: bool = True  # probes on /v1/chat/completions, else /v1/completions
    stream: bool = True
    reasoning: bool = False
    tool_call: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateSpec:
        return cls(**data)


def _request(
    url: str, *, body: dict[str, Any] | None = None, key: str | None = None, timeout: float
) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GateError(f"{url}: cannot connect ({reason})") from None


def metric_sum(text: str, name: str) -> float:
    """Sum of all samples of one metric (over label sets) in Prometheus text."""
    return sum(value for sample, _, value in parse_samples(text) if sample == name)


def _metrics_text(url: str) -> str:
    status, text = _request(url, timeout=10)
    if status != 200:
        raise GateError(f"{url}: HTTP {status}")
    return text


@dataclass
class KvCounters:
    """One reading of the P/D engines' KV evidence (sums over the engines and label sets)."""

    served: float = 0.0  # vLLM: NIXL transfers on the decodes; SGLang: the prefills' requests
    failed: float = 0.0
    nbytes: float = 0.0  # vLLM: bytes the decodes pulled over NIXL
    tokens: dict[str, float] = field(default_factory=dict)  # vLLM decode prompt tokens by source


def vllm_decode_counters(texts: list[str]) -> KvCounters:
    """The KV evidence in vLLM decodes' /metrics texts.

    >>> c = vllm_decode_counters(['vllm:nixl_xfer_time_seconds_count{engine="0"} 2',
    ...     'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 190'])
    >>> c.served, c.tokens
    (2.0, {'external_kv_transfer': 190.0})
    """
    out = KvCounters()
    for text in texts:
        for name, labels, value in parse_samples(text):
            if name == XFER_COUNT:
                out.served += value
            elif name == XFER_FAILED:
                out.failed += value
            elif name == XFER_BYTES:
                out.nbytes += value
            elif name == TOKENS_BY_SOURCE and "source" in labels:
                source = labels["source"]
                out.tokens[source] = out.tokens.get(source, 0.0) + value
    return out


def _kv_counters(spec: GateSpec) -> KvCounters:
    """The KV evidence of the topology's P/D engines, read now."""
    if spec.pd_engine == "vllm":
        return vllm_decode_counters([_metrics_text(url) for url in spec.decode_metrics])
    urls = dict.fromkeys(spec.decode_metrics + spec.prefill_metrics)
    texts = {url: _metrics_text(url) for url in urls}
    served = sum(metric_sum(texts[url], SGL_REQUESTS) for url in spec.prefill_metrics)
    failed = sum(metric_sum(text, name) for text in texts.values() for name in SGL_FAILED)
    return KvCounters(served=served, failed=failed)


def vllm_kv_evidence(before: KvCounters, after: KvCounters, spec: GateSpec) -> str:
    """What the decodes' NIXL and prompt-token counters show for the gate's P/D requests; fails
    when the decodes count prompt tokens by source and none came from KV transfer."""
    transfers = after.served - before.served
    said = f"gate: decode pulled KV over NIXL {transfers:.0f} times"
    if after.nbytes > before.nbytes:
        said += f" ({after.nbytes - before.nbytes:.0f} B)"
    if after.tokens:
        grew = {k: v - before.tokens.get(k, 0.0) for k, v in after.tokens.items()}
        external = grew.get("external_kv_transfer", 0.0)
        if external <= 0:
            raise GateError(
                f"decode pulled KV over NIXL {transfers:.0f} times but counted no prompt tokens "
                f"from KV transfer ({', '.join(f'{k} +{v:.0f}' for k, v in sorted(grew.items()))})"
                ": it computed the P/D prompts itself"
            )
        said += (
            f", prompt tokens from KV transfer +{external:.0f}, "
            f"computed locally +{grew.get('local_compute', 0.0):.0f}"
        )
    said += ", 0 failures"
    return said + (f"; {spec.kv_transport}" if spec.kv_transport else "")


INSTANCE_HEALTHY = "hgxserve_proxy_instance_healthy"


def wait_instances_admitted(
    base: str, timeout_s: float, log: Any, metrics_key: str | None = None
) -> None:
    """Wait until the proxy has every engine in rotation (its health checks run on an interval,
    so right after start a request could fall back to combined and hide a P/D problem)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, text = _request(f"{base}/metrics", key=metrics_key, timeout=10)
        samples = [
            (labels.get("instance", ""), value)
            for name, labels, value in parse_samples(text)
            if name == INSTANCE_HEALTHY
        ]
        if status == 200 and not samples:
            return  # not hgxserve's proxy: nothing to wait for
        down = [labels for labels, value in samples if value != 1]
        if status == 200 and not down:
            log(f"gate: proxy has all {len(samples)} engines in rotation")
            return
        if time.monotonic() > deadline:
            raise GateError(f"proxy still has engines out of rotation: {', '.join(down)}")
        time.sleep(1)


def _padded(prompt: str, length: str, words: int) -> str:
    """The probe's prompt, for `long` preceded by filler so the proxy routes it through P/D."""
    if length == "short":
        return prompt
    # a fresh first line: no engine holds this prompt's prefix, so a KV-aware proxy sees every
    # token uncached and sends it through a prefill (never `pd-local`; docs/proxy.md)
    fresh = f"Probe {secrets.token_hex(8)}."
    filler = " ".join(f"Context line {i} can be ignored." for i in range(words // 5 + 1))
    return f"{fresh} {filler}\n{prompt}"


def _check_answer(spec: GateSpec, text: str, what: str) -> None:
    answer = text.strip()
    regex = spec.probe.get("expect_regex")
    if regex:
        if not re.search(regex, answer):
            raise GateError(f"{what} answered {answer[:200]!r}, not matching /{regex}/")
        return
    expect = str(spec.probe.get("expect") or "")
    if expect not in answer:
        raise GateError(f"{what} answered {answer[:200]!r}, expected {expect!r}")


def _as_endpoint(spec: GateSpec, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(path, body) for the probe: chat messages, or for `chat: false` the plain prompt."""
    body = {"model": spec.served_name, "temperature": 0, **body}
    if spec.chat or "tools" in body:
        return "/v1/chat/completions", body
    text = "\n".join(m["content"] for m in body.pop("messages"))
    body.pop("chat_template_kwargs", None)
    return "/v1/completions", {**body, "prompt": text}


def _chat(spec: GateSpec, base: str, key: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """The answer's message (for `chat: false`, {"content": the completion's text})."""
    path, body = _as_endpoint(spec, body)
    status, text = _request(f"{base}{path}", body=body, key=key, timeout=spec.timeout_s)
    if status != 200:
        raise GateError(f"{path} through the proxy answered HTTP {status}: {text[:300]}")
    choice: dict[str, Any] = (json.loads(text).get("choices") or [{}])[0]
    if path == "/v1/completions":
        return {"content": choice.get("text") or ""}
    message: dict[str, Any] = choice.get("message") or {}
    return message


def _stream(spec: GateSpec, base: str, key: str | None, body: dict[str, Any]) -> str:
    """A streamed probe: the content deltas joined; fails without a final `data: [DONE]`."""
    path, body = _as_endpoint(spec, {"stream": True, **body})
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(), headers=headers)
    parts: list[str] = []
    chunks, done = 0, False
    try:
        with urllib.request.urlopen(req, timeout=spec.timeout_s) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunks += 1
                for choice in json.loads(data).get("choices") or []:
                    delta = choice.get("delta") or {}
                    parts.append(str(delta.get("content") or choice.get("text") or ""))
    except urllib.error.HTTPError as exc:
        raise GateError(f"streamed {path} through the proxy answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise GateError(f"streamed {path} through the proxy broke off: {exc}") from None
    if not done:
        raise GateError(f"streamed {path} ended after {chunks} chunks without data: [DONE]")
    return "".join(parts)


def _probe_pass(spec: GateSpec, base: str, key: str | None, log: Any) -> int:
    """The expected-answer, streaming, reasoning and tool-call probes; returns how many
    requests went at the long (P/D) length."""
    prompt = str(spec.probe.get("prompt") or "")
    max_tokens = int(spec.probe.get("max_tokens") or 32)
    long_requests = 0
    for length in spec.lengths:
        text = _padded(prompt, length, spec.prompt_words)
        ask = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "chat_template_kwargs": NO_THINKING,
        }
        where = "through P/D" if length == "long" else "on the combined path"
        kind = "chat" if spec.chat else "completion"
        message = _chat(spec, base, key, ask)
        _check_answer(spec, str(message.get("content") or ""), f"the {kind} probe ({where})")
        log(f"gate: {kind} probe {where} answered {str(message.get('content')).strip()[:60]!r}")
        long_requests += length == "long"
        if spec.stream:
            _check_answer(spec, _stream(spec, base, key, ask), f"the streamed probe ({where})")
            log(f"gate: streamed {kind} probe {where} ok")
            long_requests += length == "long"
    length = spec.lengths[-1]
    if spec.reasoning:
        ask = {
            "messages": [{"role": "user", "content": _padded(prompt, length, spec.prompt_words)}],
            "max_tokens": max(max_tokens, 256),
        }
        message = _chat(spec, base, key, ask)
        thought = message.get("reasoning_content") or message.get("reasoning")
        if not thought:
            raise GateError(
                "the reasoning probe got no reasoning content: the reasoning parser does not "
                f"split the model's thinking (message keys: {sorted(message)})"
            )
        log(f"gate: reasoning probe returned {len(str(thought))} characters of reasoning")
        long_requests += length == "long"
    if spec.tool_call:
        ask = {
            "messages": [
                {"role": "user", "content": _padded(TOOL_PROMPT, length, spec.prompt_words)}
            ],
            "max_tokens": max(max_tokens, 256),
            "tools": [TOOL],
            "tool_choice": "auto",
            "chat_template_kwargs": NO_THINKING,
        }
        calls = _chat(spec, base, key, ask).get("tool_calls") or []
        names = [(c.get("function") or {}).get("name") for c in calls]
        if "get_weather" not in names:
            raise GateError(f"the tool-call probe got tool calls {names}, not get_weather")
        arguments = (calls[names.index("get_weather")].get("function") or {}).get("arguments")
        try:
            if not isinstance(json.loads(arguments or ""), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise GateError(f"the tool call's arguments are not a JSON object: {exc}") from None
        log(f"gate: tool-call probe called get_weather({arguments})")
        long_requests += length == "long"
    return long_requests


def run_gate(spec: GateSpec, log: Any = print) -> dict[str, Any]:
    """Run every check; return a summary or raise GateError naming the failed check."""
    key = _api_key(spec)
    base = spec.proxy_url.rstrip("/")
    _check_front_door(spec, base, key, log)
    metrics_key = _key_file(spec.metrics_key_file, "proxy /metrics key")
    wait_instances_admitted(base, spec.instances_timeout_s, log, metrics_key)
    before = _kv_counters(spec) if spec.pd_engine else KvCounters()
    completion = _deterministic_completion(spec, base, key)
    log(f"gate: deterministic completion {completion!r}")
    result: dict[str, Any] = {"completion": completion}
    pd_requests = 2 if spec.pd_engine else 0
    if spec.probe:
        long_requests = _probe_pass(spec, base, key, log)
        pd_requests += long_requests if spec.pd_engine else 0
    if spec.pd_engine:
        result["kv_transfers"] = _check_kv_moved(spec, before, pd_requests, log)
    return result


def _api_key(spec: GateSpec) -> str | None:
    return _key_file(spec.api_key_file, "proxy API key")


def _key_file(path: str | None, what: str) -> str | None:
    if not path:
        return None
    try:  # the key the release wrote (0600), or the topology's file / credential store file
        return read_key_file(path, what)
    except KeyFileError as exc:
        raise GateError(str(exc)) from None


def _check_front_door(spec: GateSpec, base: str, key: str | None, log: Any) -> None:
    """The proxy's /health answers 200 and its /v1/models names the served model."""
    status, _ = _request(f"{base}/health", timeout=10)
    if status != 200:
        raise GateError(f"proxy /health answered HTTP {status}")
    log(f"gate: proxy /health ok ({base})")
    status, text = _request(f"{base}/v1/models", key=key, timeout=10)
    if status != 200:
        raise GateError(f"proxy /v1/models answered HTTP {status}: {text[:200]}")
    names = [m.get("id") for m in json.loads(text).get("data", [])]
    if spec.served_name not in names:
        raise GateError(f"/v1/models lists {names}, not the served model '{spec.served_name}'")
    log(f"gate: /v1/models lists {spec.served_name}")


def _deterministic_completion(spec: GateSpec, base: str, key: str | None) -> str:
    """A completion at temperature 0, asked twice: its text, when both are the same and not
    empty."""
    prompt = " ".join(f"hgxserve gate check {i}." for i in range(spec.prompt_words // 4 + 1))
    body = {"model": spec.served_name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    texts = []
    for _ in range(2):
        url = f"{base}/v1/completions"
        status, text = _request(url, body=body, key=key, timeout=spec.timeout_s)
        if status != 200:
            raise GateError(f"completion through the proxy answered HTTP {status}: {text[:300]}")
        choice = (json.loads(text).get("choices") or [{}])[0]
        texts.append(choice.get("text") or "")
    if not texts[0]:
        raise GateError("completion through the proxy returned no text")
    if texts[0] != texts[1]:
        raise GateError(f"completion at temperature 0 is not deterministic: {texts!r}")
    completion: str = texts[0]
    return completion


def _check_kv_moved(spec: GateSpec, before: KvCounters, pd_requests: int, log: Any) -> float:
    """The P/D engines' counters since `before` show a KV transfer for every P/D request and no
    failure; the number of transfers."""
    after = _kv_counters(spec)
    transfers, failures = after.served - before.served, after.failed - before.failed
    if failures > 0:
        raise GateError(
            f"decode reported {failures:.0f} failed KV transfers: it recomputed the prompt "
            "instead of pulling KV (check the NIXL side channel address and P/D TP)"
            if spec.pd_engine == "vllm"
            else f"SGLang reported {failures:.0f} failed KV bootstraps/transfers "
            "(check the prefill's bootstrap port and --disaggregation-ib-device)"
        )
    if transfers < pd_requests:
        what = "decode pulled KV" if spec.pd_engine == "vllm" else "prefill served"
        raise GateError(
            f"{what} {transfers:.0f} times for {pd_requests} P/D requests: requests were "
            "served without P/D KV transfer (silent local recompute or no P/D routing)"
        )
    if spec.pd_engine == "vllm":
        log(vllm_kv_evidence(before, after, spec))
    else:
        log(f"gate: SGLang prefill served {transfers:.0f} P/D requests, 0 failed transfers")
    return transfers
