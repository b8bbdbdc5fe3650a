"""Warm-up requests for the topology's real request shapes (input x output x concurrency).

Prompts are token ids (`"prompt": [ids]`, accepted by vLLM and SGLang completions), so a shape
of 4096 input tokens is exactly 4096 tokens with any tokenizer. Each request of a shape gets a
different prefix, so prefix caching cannot turn the warm-up into cache hits. All requests of a
shape are sent at once, so batched kernels of that concurrency are exercised too.

    >>> plan = warmup_plan([Shape(128, 64, 8)], max_model_len=4096)
    >>> [(s.input, s.output, s.concurrency, s.label) for s in plan][-1]
    (4080, 16, 1, 'near-max')
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

NEAR_MAX_OUTPUT = 16
# Token ids below 256 exist in every vocabulary, even byte-level ones of tiny test models.
_ID_LOW, _ID_SPAN = 10, 240


@dataclass(frozen=True)
class Shape:
    input: int
    output: int
    concurrency: int = 1
    api: str = "completions"
    label: str = "topology"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def warmup_plan(shapes: list[Shape], max_model_len: int | None) -> list[Shape]:
    """The topology's shapes plus one near max_model_len (seed 003 §8.2), without duplicates.

    Shapes that do not fit max_model_len are clipped to fit, since the engine rejects them.
    """
    plan: list[Shape] = []
    for shape in shapes:
        if max_model_len and shape.input + shape.output > max_model_len:
            output = min(shape.output, max(1, max_model_len // 2))
            shape = Shape(max_model_len - output, output, shape.concurrency, shape.api, "clipped")
        if shape not in plan:
            plan.append(shape)
    if max_model_len and max_model_len > NEAR_MAX_OUTPUT + 1:
        near = Shape(max_model_len - NEAR_MAX_OUTPUT, NEAR_MAX_OUTPUT, 1, "completions", "near-max")
        if all(s.input < near.input for s in plan):
            plan.append(near)
    return plan


def prompt_ids(length: int, salt: int) -> list[int]:
    """`length` token ids whose first ones differ per salt (defeats prefix caching)."""
    ids = []
    state = (salt * 2654435761 + 12345) & 0xFFFFFFFF
    for _ in range(length):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        ids.append(_ID_LOW + state % _ID_SPAN)
    return ids


@dataclass
class ShapeResult:
    shape: Shape
    ok: int
    errors: list[str]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.shape.as_dict(),
            "ok": self.ok,
            "errors": self.errors[:5],
            "seconds": round(self.seconds, 3),
        }


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class Engine:
    """Where warm-up requests go: the engine's base URL, the model it serves, its API key and
    how long one request may take."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 600


def _request(engine: Engine, shape: Shape, salt: int) -> str | None:
    if shape.api == "chat":
        # Text of ~4 characters per token; chat prompts cannot be given as ids.
        words = " ".join(f"w{(salt + i) % 997}" for i in range(max(1, shape.input // 2)))
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": words}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt_ids(shape.input, salt)}
    body.update(
        model=engine.model,
        max_tokens=shape.output,
        temperature=0,
        ignore_eos=True,  # vLLM and SGLang: always generate `output` tokens
        stream=False,
    )
    req = urllib.request.Request(
        engine.base_url.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **_headers(engine.api_key)},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=engine.timeout) as resp:
            resp.read()
        return None
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", errors="replace")
        return f"HTTP {exc.code}: {detail}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


def run_shape(engine: Engine, shape: Shape, round_no: int) -> ShapeResult:
    """Send `concurrency` requests of one shape at the same time and wait for all."""
    started = time.monotonic()
    salts = [round_no * 100_003 + shape.input * 7 + i for i in range(shape.concurrency)]
    with ThreadPoolExecutor(max_workers=shape.concurrency) as pool:
        outcomes = list(pool.map(lambda s: _request(engine, shape, s), salts))
    errors = [o for o in outcomes if o]
    return ShapeResult(shape, len(outcomes) - len(errors), errors, time.monotonic() - started)


def served_model(base_url: str, timeout: float = 10, api_key: str | None = None) -> str | None:
    """The first model id from /v1/models, or None."""
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def shapes_arg(shapes: list[Shape]) -> str:
    """Shapes as one command-line word: `128x64x8,4096x128x4:chat` (input x output x concurrency).

    >>> shapes_arg([Shape(128, 64, 8), Shape(4096, 128, 4, "chat")])
    '128x64x8,4096x128x4:chat'
    """
    return ",".join(
        f"{s.input}x{s.output}x{s.concurrency}" + (":chat" if s.api == "chat" else "")
        for s in shapes
    )


def parse_shapes(text: str) -> list[Shape]:
    """The inverse of shapes_arg; ValueError on anything else.

    >>> [(s.input, s.api) for s in parse_shapes("16x8x4,128x16x2:chat")]
    [(16, 'completions'), (128, 'chat')]
    """
    shapes = []
    for item in filter(None, text.split(",")):
        dims, _, api = item.partition(":")
        parts = dims.split("x")
        if (
            len(parts) != 3
            or not all(p.isdigit() and int(p) > 0 for p in parts)
            or api
            not in (
                "",
                "chat",
            )
        ):
            raise ValueError(f"not a warm-up shape (INPUTxOUTPUTxCONCURRENCY[:chat]): {item!r}")
        shapes.append(Shape(int(parts[0]), int(parts[1]), int(parts[2]), api or "completions"))
    return shapes


def warm_up(
    base_url: str,
    shapes: list[Shape],
    log: Any,
    timeout: float = 600,
    api_key: str | None = None,
) -> list[str]:
    """Send every shape to the engine at `base_url` (before any proxy admits it), with the
    engine's API key when it has one; return the errors (empty when every request of every
    shape was answered)."""
    model = served_model(base_url, api_key=api_key)
    if model is None:
        return [f"{base_url}/v1/models names no model"]
    engine = Engine(base_url, model, api_key, timeout)
    errors: list[str] = []
    for shape in shapes:
        result = run_shape(engine, shape, round_no=0)
        log(
            f"hgxserve warm-up: {shape.input}x{shape.output}x{shape.concurrency} {shape.api} "
            f"({shape.label}): {result.ok}/{shape.concurrency} answered in {result.seconds:.2f} s"
        )
        errors += [f"{shape.input}x{shape.output}: {e}" for e in result.errors]
    return errors
