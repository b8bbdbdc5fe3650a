"""The client's request body as the proxy handles it: parsed once as strict JSON, stripped of the
fields only the proxy may set, extended with the proxy's own fields without re-encoding the
client's bytes, sized for routing; and the request's id.

    body = parse_body(raw)                                  # ValueError unless strict JSON
    raw, body = strip_transfer_fields(raw, body)            # no client kv_transfer_params
    decode_raw = with_fields(raw, body, {"kv_transfer_params": params})
    tokens = estimate_prompt_tokens(body, bytes_per_token=4.0)
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

# Fields that tell an engine where to fetch or send KV: only the proxy sets them. A client's
# own would make a decode dial a host:port of the client's choosing.
TRANSFER_FIELDS = ("kv_transfer_params",)
TRANSFER_PREFIXES = ("bootstrap_",)
# X-Request-Id values passed on as they came; anything else gets a fresh id
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")


def new_request_id() -> str:
    """A random 128-bit request id in hex (as uuid4().hex, at a fraction of its cost)."""
    return f"{random.getrandbits(128):032x}"


def request_id(client_id: str | None) -> str:
    """The proxy's own id for a request: unique whatever clients send (two clients may send
    one id), led by the client's X-Request-Id when it is short and plain so the request stays
    findable by it in every log (the client's id also travels as X-Client-Request-Id).

    Example: request_id("abc-1")[:6] == "abc-1."; len(request_id("a b")) == 32
    """
    own = new_request_id()
    return f"{client_id}.{own[:16]}" if client_id and REQUEST_ID.match(client_id) else own


def client_request_id(client_id: str | None) -> str | None:
    """The client's X-Request-Id as it may travel on (short and plain), else None."""
    return client_id if client_id and REQUEST_ID.match(client_id) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# one decoder and one encoder for every request (json.loads/dumps with arguments build one per
# call, which cost more than encoding a short body)
_STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def compact_json(value: Any) -> bytes:
    """`value` as compact JSON bytes (ASCII: non-ASCII text escaped, as json.dumps does).

    Example: compact_json({"a": [1, 2]}) == b'{"a":[1,2]}'
    """
    return _COMPACT.encode(value).encode()


def parse_body(raw: bytes) -> Any:
    """The client's JSON; ValueError for anything that is not strict JSON (NaN, Infinity,
    invalid UTF-8, nesting deep enough to exhaust the parser).

    Example: parse_body(b'{"a": 1}') == {"a": 1}
    """
    try:
        # as json.loads does with bytes, then the strict decoder
        return _STRICT_JSON.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _transfer_field(key: str) -> bool:
    return key in TRANSFER_FIELDS or key.startswith(TRANSFER_PREFIXES)


def _nested_transfer(body: dict[str, Any]) -> bool:
    """vLLM passes `vllm_xargs` on to the request's extra args: a transfer field there is one."""
    xargs = body.get("vllm_xargs")
    return isinstance(xargs, dict) and any(_transfer_field(k) for k in xargs)


def strip_transfer_fields(raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The body without client-supplied KV transfer fields (top level, and inside
    `vllm_xargs`); the client's bytes when it had none.

    Example: strip_transfer_fields(b'{"kv_transfer_params":{}}', {"kv_transfer_params": {}})
             == (b'{}', {})
    """
    for key in body:
        if key in TRANSFER_FIELDS or key.startswith(TRANSFER_PREFIXES):
            break
    else:
        if not _nested_transfer(body):
            return raw, body  # (the usual case: one pass over the keys, no call per key)
    clean = {k: v for k, v in body.items() if not _transfer_field(k)}
    if _nested_transfer(clean):
        xargs = {k: v for k, v in clean["vllm_xargs"].items() if not _transfer_field(k)}
        clean["vllm_xargs"] = xargs
    return compact_json(clean), clean


def with_fields(raw: bytes, body: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """The client's JSON body with `extra` keys added, keeping the client's bytes when it can.

    Appending to the original bytes avoids re-encoding every prompt; a body that already has
    one of the keys (or is empty, or not plain UTF-8 JSON) is re-encoded instead.

    Example: with_fields(b'{"a": 1}', {"a": 1}, {"b": 2}) == b'{"a": 1,"b":2}'
    """
    if body and raw.lstrip()[:1] == b"{" and not any(k in body for k in extra):
        return b"".join((raw[: raw.rfind(b"}")], b",", compact_json(extra)[1:]))
    return compact_json({**body, **extra})


def estimate_prompt_tokens(body: dict[str, Any], bytes_per_token: float) -> int:
    """Cheap prompt length estimate: UTF-8 bytes / bytes_per_token (token ids counted exactly).

    Example: estimate_prompt_tokens({"prompt": "x" * 400}, 4.0) == 100
    """
    size = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        size = len(prompt.encode(errors="replace"))
    elif isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        size = sum(len(p.encode(errors="replace")) for p in prompt if isinstance(p, str))
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            size += len(content.encode(errors="replace"))
        elif isinstance(content, list):
            size += sum(
                len(str(p.get("text", "")).encode(errors="replace"))
                for p in content
                if isinstance(p, dict)
            )
    return int(size / bytes_per_token)
