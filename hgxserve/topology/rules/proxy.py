"""Rules on the proxy and how it routes: proxy-* and kv-events-*.

The proxy routes somewhere, every combined engine is reachable through it, a router's kind
matches the engines' P/D protocol and takes no auth nor a mix of routes and combined engines,
the hgxserve proxy speaks one P/D protocol within the limits its own config loader accepts, and
an engine routed by KV events publishes events the proxy can route by. Most are refusals the
renderer would otherwise raise at deploy time (hgxserve.topology.wiring): `validate` finds them
with their position.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.model import Engine, Proxy, Topology
from hgxserve.topology.ports import proxy_targets, publishes_kv_events, setting_path
from hgxserve.topology.registry import ROUTERS, Finding, engine_rule, proxy_rule
from hgxserve.topology.wiring import route_engines

FAMILY = ("proxy-", "kv-events-")


# What `hgxserve proxy serve` accepts (hgxserve.proxy.config: limits.max_body_bytes >= 1 KiB and
# <= max_buffered_body_bytes, 512 MiB by default; timeouts >= 0.01 s); tests/render keeps these
# equal to the proxy's own checks.
PROXY_MIN_BODY = 1024
PROXY_MAX_BODY = 512 * 1024 * 1024
PROXY_MIN_TIMEOUT_S = 0.01


@proxy_rule(
    "proxy-targets",
    "error",
    "The proxy routes somewhere; a prompt-length split has both sides.",
    why="a proxy with nothing behind it, or short prompts with nowhere to go",
)
def proxy_targets_rule(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    if not proxy.routes and not proxy.combined:
        yield (
            ("proxy",),
            "the proxy routes to no engine; list combined engines in proxy.combined or P/D "
            "groups in proxy.routes",
        )
    if proxy.pd_min_prompt_tokens > 0 and not proxy.combined:
        yield (
            ("proxy", "pd_min_prompt_tokens"),
            f"prompts under {proxy.pd_min_prompt_tokens} tokens go to combined engines, but "
            "proxy.combined is empty; add a combined engine or set pd_min_prompt_tokens: 0",
        )


@engine_rule(
    "proxy-combined-unlisted",
    "warning",
    "Combined engines are reachable through the proxy.",
    why="a combined engine the proxy never uses wastes its GPUs",
)
def proxy_combined_unlisted(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if topo.proxy is None:
        return
    if engine.role == "combined" and engine.name not in topo.proxy.combined:
        yield (
            ("engines", engine.name, "role"),
            f"combined engine {engine.name} is not in proxy.combined, so the proxy never "
            "sends it requests; add it there",
        )


@proxy_rule(
    "proxy-kind",
    "error",
    "The router kind matches the engines' P/D protocol.",
    kinds=ROUTERS,
    why="vllm-router and sglang-router speak different P/D protocols",
)
def proxy_kind(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    want = "vllm" if proxy.kind == "vllm-router" else "sglang"
    for name in sorted(proxy_targets(topo)):
        engine = topo.engines.get(name)
        if engine is not None and engine.engine != want:
            yield (
                ("proxy", "kind"),
                f"{proxy.kind} speaks {want}'s P/D protocol but {name} is a {engine.engine} "
                "engine; use kind: hgxserve or a matching router",
            )
            return


@proxy_rule(
    "proxy-protocol",
    "error",
    "The hgxserve proxy's P/D routes are all vLLM or all SGLang (one P/D protocol per proxy).",
    kinds=("hgxserve",),
    why="vLLM NIXL and SGLang bootstrap P/D are different protocols; the proxy speaks one",
)
def proxy_protocol(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    kinds: dict[str, str] = {}
    for name in route_engines(topo):
        engine = topo.engines.get(name)
        if engine is not None:
            kinds.setdefault(engine.engine, name)
    if len(kinds) > 1:
        shown = ", ".join(f"{n} ({kind})" for kind, n in kinds.items())
        yield (
            ("proxy", "routes"),
            f"the proxy speaks one P/D protocol, but its routes mix vLLM and SGLang engines "
            f"({shown}); give each engine kind its own proxy (topology)",
        )


@proxy_rule(
    "proxy-router-auth",
    "error",
    "vllm-router and sglang-router take no proxy.auth.",
    kinds=ROUTERS,
    why="the routers take API keys only on their command line, where they leak",
)
def proxy_router_auth(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    if proxy.api_key is not None or proxy.engine_api_key is not None:
        yield (
            ("proxy", "auth"),
            f"proxy kind {proxy.kind} takes its API keys only on the command line, where every "
            "local user can read them; use kind: hgxserve for auth, or drop proxy.auth",
        )


@proxy_rule(
    "proxy-router-mix",
    "error",
    "vllm-router and sglang-router serve P/D routes or combined engines, not both.",
    kinds=ROUTERS,
    why="the routers have no prompt-length buckets and no combined fallback",
)
def proxy_router_mix(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    if proxy.routes and proxy.combined:
        yield (
            ("proxy", "combined"),
            f"proxy kind {proxy.kind} cannot mix P/D routes and combined engines (it has no "
            "prompt-length buckets and no combined fallback); use kind: hgxserve, or drop "
            "proxy.combined",
        )


@proxy_rule(
    "proxy-limits",
    "error",
    "The hgxserve proxy's max_body is 1Ki..512Mi and its timeout_s at least 0.01 s.",
    kinds=("hgxserve",),
    why=(
        "the proxy's own config loader refuses anything else (`hgxserve proxy serve` would "
        "not start)"
    ),
)
def proxy_limits(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    if not PROXY_MIN_BODY <= proxy.max_body <= PROXY_MAX_BODY:
        yield (
            ("proxy", "max_body"),
            f"max_body {proxy.max_body} bytes: the proxy accepts 1Ki ({PROXY_MIN_BODY}) to "
            f"512Mi ({PROXY_MAX_BODY}) (it buffers at most 512Mi of bodies in flight)",
        )
    if proxy.timeout_s < PROXY_MIN_TIMEOUT_S:
        yield (
            ("proxy", "timeout_s"),
            f"timeout_s {proxy.timeout_s}: the proxy takes at least {PROXY_MIN_TIMEOUT_S} s",
        )


def _publishes(topo: Topology, engine: Engine) -> bool:
    return publishes_kv_events(topo, engine)


@engine_rule(
    "kv-events-prefix-cache",
    "error",
    "An engine routed with policy kv-events keeps its prefix cache on (its KV events report the "
    "cached blocks; with the cache off there are none).",
    when=_publishes,
    why=(
        "with `--no-enable-prefix-caching` (vLLM) or `--disable-radix-cache` (SGLang) an "
        "engine publishes no BlockStored events: the proxy sees no prefix anywhere and "
        "kv-events routing degrades to load alone, silently"
    ),
)
def kv_events_prefix_cache(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.args.get("enable_prefix_caching") is False:
        off = "--no-enable-prefix-caching" if engine.engine == "vllm" else "--disable-radix-cache"
        yield (
            setting_path(topo, engine.name, "args", "enable_prefix_caching"),
            f"{engine.name} is routed with policy kv-events but renders {off}: an engine "
            "without a prefix cache stores no blocks and publishes no events to route by; "
            "drop enable_prefix_caching: false, or give its route policy approximate or "
            "least-outstanding (proxy.routes[].policy, proxy.combined_policy)",
        )


@engine_rule(
    "kv-events-sglang-dp",
    "error",
    "An SGLang engine routed with policy kv-events runs DP 2 or more only with DP attention "
    "(SGLang offsets its KV-event ports by the attention-DP rank, 0 for every plain DP replica).",
    engine="sglang",
    when=_publishes,
    why=(
        "SGLang's `ZmqEventPublisher` adds `attn_dp_rank` to both ports, and "
        "`compute_dp_attention_world_info` returns 0 for it without `--enable-dp-attention`: "
        "every replica binds the same port and all but one fail at start"
    ),
)
def kv_events_sglang_dp(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.dp >= 2 and not engine.dp_attention:
        yield (
            setting_path(topo, engine.name, "dp"),
            f"{engine.name}: SGLang offsets each KV-event port by the attention-DP rank, which "
            f"is 0 for all {engine.dp} replicas without enable_dp_attention, so they would all "
            "bind one port; set args.enable_dp_attention: true, or give its route policy "
            "approximate or least-outstanding",
        )
