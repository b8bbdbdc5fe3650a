"""The proxy's configuration file: a JSON document the renderer writes from the topology.

Example (vLLM NIXL, one P/D group, one combined engine for short prompts):

    {
      "listen": {"host": "0.0.0.0", "port": 8000},
      "protocol": "vllm-nixl",
      "served_model_name": "DeepSeek-V4-Flash",
      "pd_groups": [{"name": "pd-0",
                     "prefill": [{"url": "http://10.0.0.11:8100"}],
                     "decode": [{"url": "http://10.0.0.12:8200"}]}],
      "combined": [{"url": "http://10.0.0.13:8000"}],
      "routing": {"pd_min_prompt_tokens": 2049},
      "auth": {"api_key_file": "/run/credentials/hgxserve-proxy.service/api-key",
               "metrics_key_file": "/run/credentials/hgxserve-proxy.service/metrics-key"}
    }

`load_proxy_config("proxy.json")` returns a `ProxyConfig` or raises `ProxyConfigError` naming
the JSON path of every problem found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, cast, get_type_hints
from urllib.parse import urlsplit

from hgxserve.base.apikeys import KeyFileError, read_key_file
from hgxserve.base.defaults import (
    DRAIN_MARGIN_S,
    DRAIN_OUTPUT_TOKENS,
    SGLANG_BOOTSTRAP_PORT,
    SWITCH_OVERHEAD_S,
    schema_default,
)
from hgxserve.base.errors import Found
from hgxserve.base.routing import LEAST_OUTSTANDING, POLICY_NAMES
from hgxserve.base.sizes import parse_size

PROTOCOLS = ("vllm-nixl", "sglang")
T = TypeVar("T")

# What the topology schema states for the proxy ($defs.proxy), so a proxy.json that leaves them
# out behaves as a topology that does (the renderer writes them from the topology).
_LISTEN_HOST, _, _LISTEN_PORT = schema_default("proxy", "listen").rpartition(":")
LISTEN_HOST = _LISTEN_HOST.strip("[]")
LISTEN_PORT = int(_LISTEN_PORT)
PD_MIN_PROMPT_TOKENS: int = schema_default("proxy", "pd_min_prompt_tokens")
MAX_BODY_BYTES = parse_size(schema_default("proxy", "max_body"))
# the topology's one upstream timeout: the whole prefill call, and the silence between two
# bytes of a decode/combined answer
UPSTREAM_TIMEOUT_S = float(schema_default("proxy", "timeout_s"))
# KV-aware routing defaults (docs/proxy.md "KV-aware routing" names the figure behind each):
# NVIDIA Dynamo's KV router weighs uncached prefill blocks and active blocks 1:1 by default
INFLIGHT_TOKEN_WEIGHT = 1.0
# an engine holding the prefix may be up to twice as busy as the best other one: with n
# engines one hot prefix then takes at most ratio / (ratio + n - 1) of the load (40 % of 4)
STICKY_MAX_WAIT_RATIO = 2.0
# below this many uncached tokens a decode's own prefill (tens of ms on an H100/H200) costs
# less than a remote prefill's round trip and KV pull
PD_REMOTE_PREFILL_MIN_UNCACHED = 512
# multi-turn think time: a conversation's next turn within 5 minutes finds its prefix
APPROX_TTL_S = 300.0


def drain_bound(output_tokens: int, tpot_ms: float, cap_s: float) -> float:
    """Seconds the proxy lets requests in flight finish when it stops or pauses: the longest
    answer (`output_tokens`) at the TPOT the topology targets, plus DRAIN_MARGIN_S, at most
    `cap_s` (docs/proxy.md "Drain and reload").

    >>> drain_bound(8192, 40, 900)
    337.68
    """
    return round(min(output_tokens * tpot_ms / 1000 + DRAIN_MARGIN_S, cap_s), 3)


# what a proxy.json without $.limits.drain_timeout_s gets: the schema's TPOT and cap
DRAIN_TIMEOUT_S = drain_bound(
    DRAIN_OUTPUT_TOKENS,
    schema_default("proxy", "drain_tpot_ms"),
    schema_default("proxy", "drain_max_s"),
)


def pause_bound(start_timeout_s: float, drain_s: float) -> float:
    """Seconds a paused proxy waits for the release that paused it: the drain, the slowest
    engine's start timeout and what a switch spends besides (stops, GPUs, proxy).

    >>> pause_bound(1800, 337.68)
    2677.68
    """
    return round(drain_s + start_timeout_s + SWITCH_OVERHEAD_S, 3)


# what a proxy.json without $.limits.pause_max_s gets: the schema's engine start timeout
PAUSE_MAX_S = pause_bound(schema_default("engine", "start_timeout_s"), DRAIN_TIMEOUT_S)


def at_least(minimum: float, default: T) -> T:
    """A setting's default, with the least value `parse_proxy_config` accepts for it."""
    return cast(T, field(default=default, metadata={"min": minimum}))


def one_of(choices: tuple[str, ...], default: str) -> str:
    """A setting's default, with the values `parse_proxy_config` accepts for it."""
    return cast(str, field(default=default, metadata={"choices": choices}))


class ProxyConfigError(Found):
    """The proxy configuration is unreadable or invalid; the message lists every problem."""


@dataclass(frozen=True)
class Endpoint:
    """One engine's HTTP API, and for an SGLang prefill, its disaggregation bootstrap server."""

    url: str
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    # the engine's KV event publishers (one per data-parallel rank), when it publishes them
    kv_events: KVEvents | None = None


@dataclass(frozen=True)
class KVEvents:
    """Where one engine publishes its KV cache events: a ZMQ PUB address and a replay (ROUTER)
    address per data-parallel rank, in rank order (docs/proxy.md "KV-aware routing")."""

    publishers: tuple[str, ...]
    replays: tuple[str, ...] = ()
    topic: str = "kv-events"


@dataclass(frozen=True)
class PDGroup:
    """Prefill and decode engines that can be paired with each other (any P with any D)."""

    name: str
    prefill: tuple[Endpoint, ...]
    decode: tuple[Endpoint, ...]
    # this group's routing policy; None: $.routing.policy
    policy: str | None = None


@dataclass(frozen=True)
class Routing:
    """How requests are split between P/D groups and combined engines."""

    # prompts of at least this many (estimated) tokens go to P/D; shorter ones to combined
    pd_min_prompt_tokens: int = at_least(0, PD_MIN_PROMPT_TOKENS)
    # token estimate: UTF-8 bytes of the prompt text divided by this
    bytes_per_token: float = at_least(0.1, 4.0)
    # long prompts go to combined engines when no healthy P/D pair exists
    fallback_to_combined: bool = True
    # extra attempts on another instance, only before any byte reached the client
    max_retries: int = at_least(0, 1)
    # KV-aware routing (docs/proxy.md "KV-aware routing" gives each default's source).
    # least-outstanding keeps the proxy's routing as it was before KV-aware routing existed
    policy: str = one_of(POLICY_NAMES, LEAST_OUTSTANDING.name)
    # a directory with the model's tokenizer.json (and tokenizer_config.json's chat_template);
    # None: requests are matched over characters (the approximate index)
    tokenizer_dir: str | None = None
    # score = uncached prompt tokens + this x tokens in flight on the engine
    inflight_token_weight: float = at_least(0, INFLIGHT_TOKEN_WEIGHT)
    # the engine holding the longest prefix keeps a request until its estimated wait passes
    # this many times the best other engine's
    sticky_max_wait_ratio: float = at_least(1, STICKY_MAX_WAIT_RATIO)
    # vLLM NIXL: fewer uncached prompt tokens than this on the chosen decode: it prefills itself
    pd_remote_prefill_min_uncached_tokens: int = at_least(0, PD_REMOTE_PREFILL_MIN_UNCACHED)
    # overflow bounds (tokens in flight per decode / per combined engine); 0: no overflow
    pair_max_inflight_tokens: int = at_least(0, 0)
    combined_max_inflight_tokens: int = at_least(0, 0)
    # how long the approximate index remembers where a prompt prefix went
    approx_ttl_s: float = at_least(1, APPROX_TTL_S)


@dataclass(frozen=True)
class Limits:
    """What one client, and all clients together, may hold; upstream time limits (seconds).

    Defaults and where they come from are in docs/proxy.md ("Front door").
    """

    max_body_bytes: int = at_least(1024, MAX_BODY_BYTES)
    # a request head must be complete this long after the connection opened or the previous
    # answer ended (an idle keep-alive connection is closed after it too)
    header_timeout_s: float = at_least(0.01, 30.0)
    # the whole request body must arrive within this
    body_timeout_s: float = at_least(0.01, 60.0)
    # open client connections; one more gets 503 and is closed
    max_connections: int = at_least(1, 4096)
    # the share of max_connections one client address may hold (a client that opens more gets
    # the same 503): one client cannot take the door from all others. Behind a gateway or NAT
    # every client has one address: set 1.0 there.
    max_client_share: float = at_least(0.01, 0.5)
    # a streamed answer's write to a client that stopped reading may wait this long; then the
    # client is cut, and its in-flight slot and engine request released (a client reading
    # tokens as they come never waits: a token is a few hundred bytes)
    client_write_timeout_s: float = at_least(0.01, 60.0)
    # generation and /v1/models requests being handled; one more gets 429
    max_in_flight: int = at_least(1, 2048)
    # bytes of request bodies held by requests in flight; one that would pass it gets 503
    max_buffered_body_bytes: int = at_least(1024, 512 * 1024 * 1024)
    connect_timeout_s: float = at_least(0.01, 5.0)
    prefill_timeout_s: float = at_least(0.01, UPSTREAM_TIMEOUT_S)
    # longest silence between two bytes of a decode/combined answer
    read_timeout_s: float = at_least(0.01, UPSTREAM_TIMEOUT_S)
    # idle keep-alive connections to one engine, and how long one may stay idle
    upstream_max_idle: int = at_least(0, 1024)
    upstream_idle_timeout_s: float = at_least(0.01, 4.0)
    # on stop or pause, requests in flight get this long to finish (drain_bound)
    drain_timeout_s: float = at_least(0, DRAIN_TIMEOUT_S)
    # a pause that no reload or stop ends this long admits again by itself: the release that
    # paused it never came (its controller died); the renderer writes the longest switch
    pause_max_s: float = at_least(1, PAUSE_MAX_S)


@dataclass(frozen=True)
class Health:
    """Active health checks: GET <path> (non-generating), eject and readmit thresholds."""

    interval_s: float = at_least(0.01, 2.0)
    timeout_s: float = at_least(0.01, 2.0)
    unhealthy_after: int = at_least(1, 2)
    healthy_after: int = at_least(1, 1)
    path: str = "/health"


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `hgxserve proxy serve` needs; see the module docstring for the JSON shape."""

    protocol: str
    served_model_name: str
    host: str = LISTEN_HOST
    port: int = LISTEN_PORT
    pd_groups: tuple[PDGroup, ...] = ()
    combined: tuple[Endpoint, ...] = ()
    routing: Routing = field(default_factory=Routing)
    limits: Limits = field(default_factory=Limits)
    health: Health = field(default_factory=Health)
    api_key_file: str | None = None
    # the key the engines want (vLLM's VLLM_API_KEY), sent upstream as a Bearer token
    upstream_api_key_file: str | None = None
    # when set, GET /metrics wants this key as a Bearer token (Prometheus, status, drains)
    metrics_key_file: str | None = None
    # the combined engines' routing policy; None: $.routing.policy
    combined_policy: str | None = None


class _Checker:
    """Collects every problem with its JSON path instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def obj(self, value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"must be an object, not {type(value).__name__}")
            return {}
        for key in sorted(set(value) - allowed):
            self.fail(f"{path}.{key}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def number(self, value: Any, path: str, minimum: Any, integer: bool = False) -> Any:
        kinds: tuple[type, ...] = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
            what = "an integer" if integer else "a number"
            self.fail(path, f"must be {what} >= {minimum}, not {value!r}")
            return None
        return value

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str | None:
        if value not in choices:
            self.fail(path, f"must be one of {', '.join(choices)}, not {value!r}")
            return None
        return str(value)

    def url(self, value: Any, path: str) -> str:
        parts = urlsplit(value) if isinstance(value, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            self.fail(path, f"must be an http(s) URL like http://10.0.0.11:8100, not {value!r}")
            return ""
        return str(value).rstrip("/")


def _endpoint(chk: _Checker, raw: Any, path: str, sglang_prefill: bool) -> Endpoint:
    if isinstance(raw, str):
        raw = {"url": raw}
    data = chk.obj(raw, path, {"url", "bootstrap_host", "bootstrap_port", "kv_events"})
    url = chk.url(data.get("url"), f"{path}.url")
    events = (
        _kv_events(chk, data["kv_events"], f"{path}.kv_events") if "kv_events" in data else None
    )
    host = data.get("bootstrap_host")
    port = data.get("bootstrap_port")
    if not sglang_prefill and (host is not None or port is not None):
        chk.fail(path, "bootstrap_host/bootstrap_port only apply to SGLang prefill engines")
    if sglang_prefill:
        host = host or (urlsplit(url).hostname if url else None)
        if port is None:
            port = SGLANG_BOOTSTRAP_PORT
        else:
            port = chk.number(port, f"{path}.bootstrap_port", 1, True)
    return Endpoint(url=url, bootstrap_host=host, bootstrap_port=port, kv_events=events)


def _zmq_addresses(chk: _Checker, value: Any, path: str) -> tuple[str, ...]:
    ok = isinstance(value, list) and all(
        isinstance(a, str) and a.startswith("tcp://") and urlsplit(a).port for a in value
    )
    if not ok:
        chk.fail(path, f"must be a list of tcp://HOST:PORT addresses, not {value!r}")
        return ()
    return tuple(value)


def _kv_events(chk: _Checker, raw: Any, path: str) -> KVEvents | None:
    data = chk.obj(raw, path, {"publishers", "replays", "topic"})
    publishers = _zmq_addresses(chk, data.get("publishers"), f"{path}.publishers")
    if "publishers" in data and not publishers:
        chk.fail(f"{path}.publishers", "must name at least one publisher (one per DP rank)")
    replays = _zmq_addresses(chk, data.get("replays", []), f"{path}.replays")
    if replays and len(replays) != len(publishers):
        chk.fail(f"{path}.replays", "must name one replay address per publisher (DP rank)")
    topic = data.get("topic", "kv-events")
    if not isinstance(topic, str):
        chk.fail(f"{path}.topic", f"must be a string, not {topic!r}")
    if not publishers:
        return None
    return KVEvents(publishers=publishers, replays=replays, topic=str(topic))


# The sections of the file, each a dataclass: its fields are the keys, with their types,
# defaults and least values (`at_least`); a path (str) must start with /.
SECTIONS: dict[str, type] = {"routing": Routing, "limits": Limits, "health": Health}
TOP_KEYS = {
    "listen",
    "protocol",
    "served_model_name",
    "pd_groups",
    "combined",
    "combined_policy",
    "auth",
    *SECTIONS,
}
AUTH_KEYS = ("api_key_file", "upstream_api_key_file", "metrics_key_file")


def _value(chk: _Checker, value: Any, path: str, kind: Any, meta: Any) -> Any:
    """One section value, checked against its type; a number that fails is None."""
    if kind is bool:
        if not isinstance(value, bool):
            chk.fail(path, f"must be true or false, not {value!r}")
        return value
    if "choices" in meta:
        return chk.choice(value, path, meta["choices"])
    if kind is str or kind == (str | None):
        if value is None and kind is not str:
            return None
        if not isinstance(value, str) or not value.startswith("/"):
            chk.fail(path, f"must be a path starting with /, not {value!r}")
        return value
    return chk.number(value, path, meta.get("min"), kind is int)


def _section(chk: _Checker, top: dict[str, Any], key: str) -> Any:
    cls = SECTIONS[key]
    kinds = get_type_hints(cls)
    metas = {f.name: f.metadata for f in fields(cls)}
    data = chk.obj(top.get(key, {}), f"$.{key}", set(kinds))
    values = {
        name: _value(chk, data[name], f"$.{key}.{name}", kind, metas[name])
        for name, kind in kinds.items()
        if name in data
    }
    # an invalid value was reported above; keep the default so later checks can still run
    return cls(**{k: v for k, v in values.items() if v is not None})


def _list(chk: _Checker, top: dict[str, Any], key: str, what: str) -> list[Any]:
    items = top.get(key, [])
    if isinstance(items, list):
        return items
    chk.fail(f"$.{key}", f"must be a list of {what}")
    return []


def _listen(chk: _Checker, top: dict[str, Any]) -> tuple[Any, Any]:
    listen = chk.obj(top.get("listen", {}), "$.listen", {"host", "port"})
    host = listen.get("host", LISTEN_HOST)
    if not isinstance(host, str) or not host:
        chk.fail("$.listen.host", f"must be an address string, not {host!r}")
    return host, chk.number(listen.get("port", LISTEN_PORT), "$.listen.port", 1, True)


def _group(chk: _Checker, raw: Any, i: int, protocol: Any, seen: set[str]) -> PDGroup:
    path = f"$.pd_groups[{i}]"
    g = chk.obj(raw, path, {"name", "prefill", "decode", "policy"})
    policy = chk.choice(g["policy"], f"{path}.policy", POLICY_NAMES) if "policy" in g else None
    name = g.get("name", f"pd-{i}")
    if not isinstance(name, str) or name in seen:
        chk.fail(f"{path}.name", f"must be a unique string, not {name!r}")
    seen.add(str(name))
    sides: dict[str, tuple[Endpoint, ...]] = {}
    for side in ("prefill", "decode"):
        items = g.get(side)
        if not isinstance(items, list) or not items:
            chk.fail(f"{path}.{side}", f"must list at least one {side} engine URL")
            items = []
        bootstrap = protocol == "sglang" and side == "prefill"
        sides[side] = tuple(
            _endpoint(chk, e, f"{path}.{side}[{j}]", bootstrap) for j, e in enumerate(items)
        )
    return PDGroup(name=str(name), prefill=sides["prefill"], decode=sides["decode"], policy=policy)


def _groups(chk: _Checker, top: dict[str, Any], protocol: Any) -> list[PDGroup]:
    seen: set[str] = set()
    raw_groups = _list(chk, top, "pd_groups", "{name, prefill: [...], decode: [...]}")
    return [_group(chk, raw, i, protocol, seen) for i, raw in enumerate(raw_groups)]


def _auth(chk: _Checker, top: dict[str, Any]) -> dict[str, Any]:
    auth = chk.obj(top.get("auth", {}) or {}, "$.auth", set(AUTH_KEYS))
    for key in AUTH_KEYS:
        value = auth.get(key)
        if value is not None and (not isinstance(value, str) or not value.startswith("/")):
            chk.fail(f"$.auth.{key}", f"must be an absolute path, not {value!r}")
    return auth


def _check_together(
    chk: _Checker, routing: Routing, limits: Limits, groups: list[PDGroup], combined: Any
) -> None:
    """What no one setting shows: limits that rule each other out, short prompts with nowhere
    to go."""
    if limits.max_buffered_body_bytes < limits.max_body_bytes:
        chk.fail(
            "$.limits.max_buffered_body_bytes",
            f"must be at least max_body_bytes ({limits.max_body_bytes}), or no body that large "
            "could ever be accepted",
        )
    if routing.pd_min_prompt_tokens > 0 and groups and not combined:
        chk.fail(
            "$.routing.pd_min_prompt_tokens",
            "short prompts need combined engines: add $.combined or set it to 0",
        )


def parse_proxy_config(raw: Any) -> ProxyConfig:
    """Validate a decoded JSON document and build the typed configuration.

    Example: parse_proxy_config({"protocol": "vllm-nixl", "served_model_name": "m",
                                 "combined": ["http://127.0.0.1:8100"]})
    """
    chk = _Checker()
    top = chk.obj(raw, "$", TOP_KEYS)
    protocol = top.get("protocol")
    if protocol not in PROTOCOLS:
        chk.fail("$.protocol", f"must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    name = top.get("served_model_name")
    if not isinstance(name, str) or not name:
        chk.fail("$.served_model_name", "must be a non-empty string (the model name clients use)")
    host, port = _listen(chk, top)
    groups = _groups(chk, top, protocol)
    combined = tuple(
        _endpoint(chk, e, f"$.combined[{j}]", False)
        for j, e in enumerate(_list(chk, top, "combined", "engine URLs"))
    )
    if not groups and not combined:
        chk.fail("$", "needs at least one of pd_groups or combined: there is nowhere to route")
    routing, limits, health = (_section(chk, top, key) for key in SECTIONS)
    combined_policy = top.get("combined_policy")
    if combined_policy is not None:
        combined_policy = chk.choice(combined_policy, "$.combined_policy", POLICY_NAMES)
    auth = _auth(chk, top)
    _check_together(chk, routing, limits, groups, combined)
    if chk.errors:
        raise ProxyConfigError("\n".join(chk.errors))
    return ProxyConfig(
        protocol=str(protocol),
        served_model_name=str(name),
        host=str(host),
        port=int(port),
        pd_groups=tuple(groups),
        combined=combined,
        routing=routing,
        limits=limits,
        health=health,
        api_key_file=auth.get("api_key_file"),
        upstream_api_key_file=auth.get("upstream_api_key_file"),
        metrics_key_file=auth.get("metrics_key_file"),
        combined_policy=combined_policy,
    )


# What a reload (SIGHUP) cannot change in a running proxy: its socket, its engine connection
# pool and the keys it read at start. A new proxy.json that changes any of these needs a restart.
RESTART_ONLY = (
    "host",
    "port",
    "api_key_file",
    "upstream_api_key_file",
    "metrics_key_file",
    "limits.header_timeout_s",
    "limits.connect_timeout_s",
    "limits.upstream_max_idle",
    "limits.upstream_idle_timeout_s",
)


def restart_needed(old: ProxyConfig, new: ProxyConfig) -> list[str]:
    """The RESTART_ONLY settings that differ between `old` and `new` (empty: a reload does).

    Example: restart_needed(cfg, replace(cfg, port=9000)) == ["port"]
    """

    def value(cfg: ProxyConfig, name: str) -> Any:
        section, _, key = name.rpartition(".")
        return getattr(getattr(cfg, section) if section else cfg, key)

    return [name for name in RESTART_ONLY if value(old, name) != value(new, name)]


def load_proxy_config(path: str | Path) -> ProxyConfig:
    """Read and validate a proxy configuration file.

    Example: cfg = load_proxy_config("/etc/hgxserve/proxy.json"); cfg.protocol == "vllm-nixl"
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProxyConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProxyConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from exc
    try:
        return parse_proxy_config(raw)
    except ProxyConfigError as exc:
        lines = str(exc).splitlines()
        raise ProxyConfigError("\n".join(f"{path}: {line}" for line in lines)) from exc


def read_api_key(path: str) -> str:
    """Read the API key from its credential file (never logged).

    Example: read_api_key("/run/credentials/hgxserve-proxy.service/api-key")
    """
    try:  # a private regular file, a key of MIN_API_KEY_LENGTH or more (hgxserve.base.apikeys)
        key = read_key_file(path)
    except KeyFileError as exc:
        raise ProxyConfigError(str(exc)) from None
    if not all("!" <= c <= "~" for c in key):
        # it goes into an HTTP header: a CR/LF or space there would split or end the header
        raise ProxyConfigError(
            f"{path}: the API key must be printable ASCII without spaces or control characters"
        )
    return key
