"""The topology-wide health gate, run on the proxy's host after every host switched.

A green `/health` is not enough (seed 003 §11.3-11.4: HTTP 200 and both engines busy while
decode silently recomputed every prompt). The gate checks, in order: the proxy's /health,
/v1/models names the served model, one deterministic completion through the proxy returns the
same non-empty text twice, and for vLLM P/D that decode really pulled KV over NIXL (its
transfer count grew and no transfer failed) instead of recomputing locally.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from hgxserve.errors import Found

# vLLM's NIXL connector metrics (KV transfer evidence on the decode side).
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
XFER_FAILED = "vllm:nixl_num_failed_transfers_total"


class GateError(Found):
    """The gate failed; the message says which check and why (exit 1: the check said no)."""


@dataclass
class GateSpec:
    proxy_url: str
    served_name: str
    api_key_file: str | None = None
    pd_engine: str | None = None  # vllm when the topology has vLLM P/D routes
    decode_metrics: list[str] = field(default_factory=list)
    prompt_words: int = 64  # long enough to pass the proxy's prompt-length bucket
    timeout_s: float = 120.0
    instances_timeout_s: float = 60.0  # for the proxy's own health checks to admit every engine

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


_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of Prometheus text as (name, labels, value); label values unescaped.

    >>> parse_samples('up{job="a",why="down"} 1')
    [('up', {'job': 'a', 'why': 'down'}, 1.0)]
    """
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_end = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)
        if not name_end:
            continue
        name, rest = name_end.group(0), line[name_end.end() :]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            pos = 1
            while pos < len(rest) and rest[pos] != "}":
                label = _LABEL.match(rest, pos)
                if not label:
                    break
                labels[label.group(1)] = re.sub(
                    r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], label.group(2)
                )
                pos = label.end()
            if pos >= len(rest) or rest[pos] != "}":
                continue  # not a sample line we understand
            rest = rest[pos + 1 :]
        parts = rest.split()
        if not parts:
            continue
        try:
            samples.append((name, labels, float(parts[0])))
        except ValueError:
            continue
    return samples


def metric_sum(text: str, name: str) -> float:
    """Sum of all samples of one metric (over label sets) in Prometheus text."""
    return sum(value for sample, _, value in parse_samples(text) if sample == name)


def _kv_counters(spec: GateSpec) -> tuple[float, float]:
    ok = failed = 0.0
    for url in spec.decode_metrics:
        status, text = _request(url, timeout=10)
        if status != 200:
            raise GateError(f"{url}: HTTP {status}")
        ok += metric_sum(text, XFER_COUNT)
        failed += metric_sum(text, XFER_FAILED)
    return ok, failed


INSTANCE_HEALTHY = "hgxserve_proxy_instance_healthy"


def wait_instances_admitted(base: str, timeout_s: float, log: Any) -> None:
    """Wait until the proxy has every engine in rotation (its health checks run on an interval,
    so right after start a request could fall back to combined and hide a P/D problem)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, text = _request(f"{base}/metrics", timeout=10)
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


def run_gate(spec: GateSpec, log: Any = print) -> dict[str, Any]:
    """Run every check; return a summary or raise GateError naming the failed check."""
    key = None
    if spec.api_key_file:
        with open(spec.api_key_file, encoding="utf-8") as fh:
            key = fh.read().strip()
    base = spec.proxy_url.rstrip("/")
    status, _ = _request(f"{base}/health", timeout=10)
    if status != 200:
        raise GateError(f"proxy /health answered HTTP {status}")
    log("gate: proxy /health ok")
    status, text = _request(f"{base}/v1/models", key=key, timeout=10)
    if status != 200:
        raise GateError(f"proxy /v1/models answered HTTP {status}: {text[:200]}")
    names = [m.get("id") for m in json.loads(text).get("data", [])]
    if spec.served_name not in names:
        raise GateError(f"/v1/models lists {names}, not the served model '{spec.served_name}'")
    log(f"gate: /v1/models lists {spec.served_name}")
    wait_instances_admitted(base, spec.instances_timeout_s, log)
    before = _kv_counters(spec) if spec.pd_engine == "vllm" else (0.0, 0.0)
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
    log(f"gate: deterministic completion {texts[0]!r}")
    result: dict[str, Any] = {"completion": texts[0]}
    if spec.pd_engine == "vllm":
        after = _kv_counters(spec)
        transfers, failures = after[0] - before[0], after[1] - before[1]
        if failures > 0:
            raise GateError(
                f"decode reported {failures:.0f} failed KV transfers: it recomputed the prompt "
                "instead of pulling KV (check the NIXL side channel address and P/D TP)"
            )
        if transfers < 2:
            raise GateError(
                f"decode pulled KV {transfers:.0f} times for 2 P/D requests: requests were served "
                "without P/D KV transfer (silent local recompute)"
            )
        log(f"gate: decode pulled KV over NIXL {transfers:.0f} times, 0 failures")
        result["kv_transfers"] = transfers
    return result
