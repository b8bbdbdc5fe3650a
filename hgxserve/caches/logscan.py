"""Recognise JIT/compile activity in engine logs (lines as vLLM, SGLang and their kernels print).

Each pattern matches a line the real libraries print when they compile (or first load) a kernel.
After `/health` is green, any of these means a request shape was not warmed and a real user would
have waited for it (seed 003 §8.2: one TileLang kernel, ~9 s, p95 TTFT 33 s).

    >>> line = "[TileLang:tilelang.jit.kernel:INFO]: TileLang begins to compile kernel `main`"
    >>> [h.source for h in scan(line)]
    ['tilelang']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (source, regex). Sources: the message formats of the libraries' own log calls.
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # vllm/compilation/backends.py: "Compiling a graph for dynamic shape takes 15.52 s",
    # "Compiling a graph for shape 8 takes ..."; vllm/compilation/monitor.py
    ("vllm", re.compile(r"Compiling a graph for (dynamic shape|shape|compile range)")),
    ("vllm", re.compile(r"torch\.compile takes? [0-9.]+ s in total")),
    ("vllm", re.compile(r"Dynamo bytecode transform time")),
    # sglang deep_gemm_wrapper/compile_utils.py
    ("deep_gemm", re.compile(r"Entering DeepGEMM JIT Pre-Compile session")),
    ("deep_gemm", re.compile(r"DeepGEMM JIT Compiling for")),
    # tilelang/jit/kernel.py: "TileLang begins to compile kernel `name` with `out_idx=[-1]`"
    ("tilelang", re.compile(r"TileLang begins to compile kernel")),
    # flashinfer/jit: "flashinfer.jit: Loading JIT ops: batch_prefill_..." (build or load)
    ("flashinfer", re.compile(r"flashinfer\.jit: Loading JIT ops")),
    # triton with TRITON_PRINT_AUTOTUNING=1: "Triton autotuning for function ..."
    ("triton", re.compile(r"Triton autotuning for function")),
    # torch inductor max-autotune benchmark tables: "AUTOTUNE mm(8x4096, 4096x4096)"
    ("inductor", re.compile(r"^\s*AUTOTUNE \w+\(")),
)


@dataclass(frozen=True)
class JitHit:
    source: str
    line: str

    def as_dict(self) -> dict[str, str]:
        return {"source": self.source, "line": self.line}


def scan(text: str) -> list[JitHit]:
    """Every line of `text` that shows JIT/compile activity, in order."""
    hits = []
    for line in text.splitlines():
        for source, pattern in PATTERNS:
            if pattern.search(line):
                hits.append(JitHit(source, line.strip()[:400]))
                break
    return hits


def read_from(path: str, offset: int) -> tuple[str, int]:
    """Whole lines appended to a log file since `offset`, and the offset after them."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1  # a line still being written is read next time
    return data[:end].decode("utf-8", errors="replace"), offset + end
