"""Where a starting engine is, read from its journal: loading weights n%, compiling, capturing
CUDA graphs, ready. Real engines take 4-25 minutes to become ready (seed 003 §6, §9.3, §12.2);
the release switch prints this for every engine it waits on, so a long start is not a silent wait.

The patterns are the engines' own log lines (vLLM and SGLang; tqdm bars end in `\\r`, so one
journal line may hold many updates: the last one counts).

>>> phase(["Loading safetensors checkpoint shards:  50% Completed | 24/48 [00:12<00:12]"])
'loading weights 50% (24/48 shards)'
>>> phase(["Capture cuda graph begin. This can take up to several minutes. avail mem=2.98 GB"])
'capturing CUDA graphs'
>>> phase(["INFO:     Application startup complete."])
'ready'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

_Rule = tuple[re.Pattern[str], Callable[[re.Match[str]], str]]

# Most recent line first; within a line, the first rule that matches names the phase.
RULES: list[_Rule] = [
    (re.compile(r"Application startup complete|The server is fired up and ready to roll"),
     lambda m: "ready"),
    (re.compile(r"Graph capturing finished in (\d+(?:\.\d+)?) secs?"),
     lambda m: f"CUDA graphs captured in {m.group(1)} s"),
    (re.compile(r"Capture (?:draft )?cuda graph end\. Time elapsed: (\d+(?:\.\d+)?) s"),
     lambda m: f"CUDA graphs captured in {m.group(1)} s"),
    (re.compile(r"Capturing CUDA graphs? (?:shapes)?\s*(?:\(([^)]*)\))?:\s*(\d+)%"),
     lambda m: f"capturing CUDA graphs {m.group(2)}%" + (f" ({m.group(1)})" if m.group(1) else "")),
    (re.compile(r"Capturing batches \(bs=(\d+)[^)]*\):\s*(\d+)%"),
     lambda m: f"capturing CUDA graphs {m.group(2)}% (batch size {m.group(1)})"),
    (re.compile(r"Capture (?:draft )?cuda graph begin"), lambda m: "capturing CUDA graphs"),
    (re.compile(r"torch\.compile takes (\d+(?:\.\d+)?) s in total"),
     lambda m: f"compiled in {m.group(1)} s (torch.compile)"),
    (re.compile(r"Compiling a graph for (?:dynamic shape|compile range [^ ]+ ?[^ ]*)"),
     lambda m: "compiling (torch.compile)"),
    (re.compile(r"(?:JIT|jit)[ _-]?compil|Compiling kernel|nvcc|ptxas"),
     lambda m: "compiling kernels (JIT)"),
    (re.compile(r"Loading weights took (\d+(?:\.\d+)?) seconds"),
     lambda m: f"weights loaded in {m.group(1)} s"),
    (re.compile(r"Load weight end"), lambda m: "weights loaded"),
    (re.compile(r"Loading safetensors checkpoint shards:\s*(\d+)% Completed \| (\d+)/(\d+)"),
     lambda m: f"loading weights {m.group(1)}% ({m.group(2)}/{m.group(3)} shards)"),
    (re.compile(r"Load weight begin|Starting to load model|Loading model from scratch"),
     lambda m: "loading weights"),
    (re.compile(r"NCCL version|Init torch distributed|world_size="),
     lambda m: "initialising distributed (NCCL)"),
]  # fmt: skip


def _segments(lines: Iterable[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        out += [seg for seg in line.split("\r") if seg.strip()]
    return out


def phase(lines: Iterable[str]) -> str | None:
    """The phase the most recent recognised journal line names; None if none is recognised."""
    for seg in reversed(_segments(lines)):
        for pattern, label in RULES:
            match = pattern.search(seg)
            if match:
                return label(match)
    return None
