"""Rules for what the renderer must be able to write: each refusal the renderer could raise is
one of these, found by `validate` with its position instead of by `render` at deploy time.

The renderer and these rules read the same functions (hgxserve.topology.wiring), so a topology
`validate` accepts renders for every host (tests/render/test_valid_renders.py checks it over
the shipped topologies, the test corpora and generated variants of them).
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.model import Engine, Proxy, Topology
from hgxserve.topology.ports import publishes_kv_events, setting_path
from hgxserve.topology.registry import ROUTERS, Finding, engine_rule, proxy_rule, rule
from hgxserve.topology.wiring import (
    ENGINE_KEY_VAR,
    LoadedCredential,
    host_credentials,
    keyed_by_proxy,
    route_engines,
)
from hgxserve.topology.wiring import proxy_protocol as proxy_protocol_of

# What `hgxserve proxy serve` accepts (hgxserve.proxy.config: limits.max_body_bytes >= 1 KiB and
# <= max_buffered_body_bytes, 512 MiB by default; timeouts >= 0.01 s); tests/render keeps these
# equal to the proxy's own checks.
PROXY_MIN_BODY = 1024
PROXY_MAX_BODY = 512 * 1024 * 1024
PROXY_MIN_TIMEOUT_S = 0.01


@engine_rule("engine-runtime", "error", "Every engine names its runtime (a venv or an image).")
def engine_runtime(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.runtime is None:
        yield (
            ("engines", engine.name),
            f"{engine.name} has no runtime: nothing says which {engine.engine} to run; set "
            "runtime: {venv: /opt/...} or {image: ...@sha256:...} here or in defaults",
        )


@proxy_rule(
    "proxy-protocol",
    "error",
    "The hgxserve proxy's P/D routes are all vLLM or all SGLang (one P/D protocol per proxy).",
    kinds=("hgxserve",),
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
    "proxy-router-auth", "error", "vllm-router and sglang-router take no proxy.auth.", kinds=ROUTERS
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


@engine_rule(
    "engine-api-key",
    "error",
    "proxy.auth.engine_api_key keys only vLLM engines that set no VLLM_API_KEY of their own.",
)
def engine_api_key(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not keyed_by_proxy(topo, engine):
        return
    if engine.engine != "vllm":
        yield (
            ("proxy", "auth", "engine_api_key"),
            f"engine {engine.name} is {engine.engine}, which takes its key only as "
            "--api-key on the command line, where every local user can read it; keep it on "
            "the proxy's host (it listens on loopback there) or firewall its port, and drop "
            "engine_api_key",
        )
        return
    for section in ("secret_env", "env"):
        if ENGINE_KEY_VAR in getattr(engine, section):
            yield (
                setting_path(topo, engine.name, section, ENGINE_KEY_VAR),
                f"{ENGINE_KEY_VAR} of {engine.name} is set here and by "
                "proxy.auth.engine_api_key; set it in one place (proxy.auth.engine_api_key)",
            )


def _shown(cred: LoadedCredential) -> str:
    who = "the proxy" if cred.unit == "proxy" else cred.unit
    return f"{cred.ref.kind}:{cred.ref.value} for {who}"


@rule(
    "credential-names",
    "error",
    "On each host one credential name stands for one secret (units load them by name).",
)
def credential_names(topo: Topology) -> Iterator[Finding]:
    for host in topo.hosts_in_use():
        first: dict[str, LoadedCredential] = {}
        for cred in host_credentials(topo, host):
            known = first.setdefault(cred.name, cred)
            if known is cred or (known.ref == cred.ref and known.path == cred.path):
                continue
            yield (
                cred.at,
                f"on {host} the credential name '{cred.name}' would stand for two secrets "
                f"({_shown(known)} and {_shown(cred)}): units load credentials by name, so one "
                "would read the other's secret; rename one (a different variable, or a "
                "credential: reference with its own name)",
            )


def _publishes(topo: Topology, engine: Engine) -> bool:
    return publishes_kv_events(topo, engine)


@engine_rule(
    "kv-events-prefix-cache",
    "error",
    "An engine routed with policy kv-events keeps its prefix cache on (its KV events report the "
    "cached blocks; with the cache off there are none).",
    when=_publishes,
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


def _threshold_path(topo: Topology) -> tuple[str, ...]:
    routing = (topo.raw.get("proxy") or {}).get("routing") or {}
    if "pd_remote_prefill_min_uncached_tokens" in routing:
        return ("proxy", "routing", "pd_remote_prefill_min_uncached_tokens")
    return ("proxy",)


@proxy_rule(
    "pd-remote-prefill-threshold",
    "error",
    "A KV-aware vLLM P/D route can send prompts to its prefills: the uncached-token threshold "
    "under which a decode prefills locally is below its decodes' max_model_len.",
    kinds=("hgxserve",),
)
def pd_remote_prefill_threshold(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    if proxy_protocol_of(topo) != "vllm-nixl":
        return  # SGLang routes always prefill on the prefill engine
    threshold = proxy.routing.pd_remote_prefill_min_uncached_tokens
    for index, route in enumerate(proxy.routes):
        if not proxy.kv_aware(route):
            continue
        lengths = [
            int(topo.engines[n].args["max_model_len"])
            for n in route.decode
            if n in topo.engines and isinstance(topo.engines[n].args.get("max_model_len"), int)
        ]
        if lengths and threshold >= min(lengths):
            yield (
                _threshold_path(topo),
                f"route {index} (policy {proxy.route_policy(route)}) sends a prompt to its "
                f"prefills only when at least {threshold} of its tokens are uncached on the "
                f"chosen decode, but its decodes take at most {min(lengths)} tokens "
                "(max_model_len): every request would prefill on its decode; lower "
                "proxy.routing.pd_remote_prefill_min_uncached_tokens below that",
            )
