"""The simulated engine's opt-in speed knob (HGXSERVE_SIM_TP_EXPONENT): times divided by TP^e,
prefills one after the other, decode steps waiting for the prefill running."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from harness import SimEngine, http, sse_events

pytestmark = pytest.mark.timeout(60)

PROMPT = "x" * 400  # 100 tokens to the simulated engine (~4 characters per token)
KNOB = {
    "HGXSERVE_SIM_TP_EXPONENT": "0.8",
    "HGXSERVE_SIM_TOKEN_SECONDS": "0.02",
    "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K": "4",  # 0.4 s for the prompt at TP1
}


def args(tp: int) -> list[str]:
    # prefix caching off: both requests send one prompt, and a cached prefill would be skipped
    return ["serve", "/m", "--served-model-name", "m", "--max-model-len", "4096",
            "--tensor-parallel-size", str(tp), "--no-enable-prefix-caching"]  # fmt: skip


def stream(url: str, max_tokens: int, out: list) -> None:
    """Token arrival times (monotonic) of one streamed completion."""
    t0 = time.monotonic()
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    status, raw, _ = http("POST", url + "/v1/completions", body, timeout=30)
    assert status == 200
    events = [e for e in sse_events(raw) if isinstance(e, dict) and e.get("choices")]
    out.append((t0, time.monotonic(), len(events)))


def elapsed(url: str, max_tokens: int) -> float:
    out: list = []
    stream(url, max_tokens, out)
    return out[0][1] - out[0][0]


def test_time_scales_with_tp(tmp_path: Path) -> None:
    with SimEngine("vllm", args(4), tmp_path, env=KNOB) as fast:
        tp4 = elapsed(fast.url, 20)
    with SimEngine("vllm", args(4), tmp_path, env={**KNOB, "HGXSERVE_SIM_TP_EXPONENT": ""}) as off:
        unscaled = elapsed(off.url, 20)
    # 0.4 + 20 x 0.02 = 0.8 s without the knob; / 4^0.8 = 3.03 with it: ~0.26 s
    assert unscaled > 0.75
    assert tp4 < unscaled / 2, (tp4, unscaled)


def test_prefills_queue_and_decode_steps_wait_for_them(tmp_path: Path) -> None:
    with SimEngine("vllm", args(1), tmp_path, env=KNOB) as eng:
        long: list = []
        first = threading.Thread(target=stream, args=(eng.url, 40, long))
        first.start()
        time.sleep(0.6)  # its prefill (0.4 s) is done; it is decoding (40 x 20 ms)
        late: list = []
        second = threading.Thread(target=stream, args=(eng.url, 2, late))
        second.start()
        first.join()
        second.join()
    t0, end, _ = long[0]
    # 0.4 s prefill + 0.8 s decode, plus at least most of the second prompt's 0.4 s prefill,
    # which its decode steps waited for
    assert end - t0 > 1.4, end - t0
