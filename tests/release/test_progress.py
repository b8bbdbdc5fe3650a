"""Engine start phases read from real vLLM / SGLang log lines."""

from __future__ import annotations

import pytest

from hgxserve.release.progress import phase

VLLM = [
    "(EngineCore_DP0 pid=164) INFO 01-23 15:48:47 [cuda.py:366] Using Flash Attention backend",
    "Loading safetensors checkpoint shards:   0% Completed | 0/48 [00:00<?, ?it/s]\r"
    "Loading safetensors checkpoint shards:  63% Completed | 30/48 [00:19<00:11, 1.5it/s]",
    "(Worker_TP0 pid=48) INFO 01-14 01:49:24 [default_loader.py:267] Loading weights took 25.31 "
    "seconds",
    "(Worker_TP0 pid=48) INFO 01-14 01:49:24 [backends.py:278] Compiling a graph for compile "
    "range (1, 4096) takes 55.98 s",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|████▌     | 23/51 [00:04<00:05]",
    "(Worker_TP0 pid=20) INFO Graph capturing finished in 12 secs, took 0.49 GiB",
    "(APIServer pid=1) INFO:     Application startup complete.",
]
SGLANG = [
    "[2026-02-01 00:04:40 TP0] Load weight begin. avail mem=94.1 GB",
    "[2026-02-01 00:05:03 TP0] Load weight end. type=DeepseekV4ForCausalLM, avail mem=30.2 GB",
    "[2026-02-01 00:05:03 TP0] Capture cuda graph begin. This can take up to several minutes. "
    "avail mem=2.98 GB",
    "Capturing batches (bs=64 avail_mem=2.91 GB):  60%|██████    | 31/51 [03:50<02:30]",
    "[2026-02-01 00:11:40 TP0] Capture cuda graph end. Time elapsed: 394.00 s. mem usage=1.2 GB.",
    "[2026-02-01 00:12:01] The server is fired up and ready to roll!",
]


def after_each_line(
    lines: list[str], phases: list[str | None]
) -> list[tuple[list[str], str | None]]:
    """(the log up to each of `lines`, the phase it says then)."""
    assert len(lines) == len(phases)
    return [(lines[: n + 1], said) for n, said in enumerate(phases)]


VLLM_PHASES = [
    None,
    "loading weights 63% (30/48 shards)",
    "weights loaded in 25.31 s",
    "compiling (torch.compile)",
    "capturing CUDA graphs 45% (mixed prefill-decode, PIECEWISE)",
    "CUDA graphs captured in 12 s",
    "ready",
]
SGLANG_PHASES = [
    "loading weights",
    "weights loaded",
    "capturing CUDA graphs",
    "capturing CUDA graphs 60% (batch size 64)",
    "CUDA graphs captured in 394.00 s",
    "ready",
]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [*after_each_line(VLLM, VLLM_PHASES), *after_each_line(SGLANG, SGLANG_PHASES)],
)
def test_phase_of_the_latest_recognised_line(lines: list[str], expected: str | None) -> None:
    assert phase(lines + ["INFO 12-01 10:00:00 [metrics.py:1] unrelated line"]) == expected
