"""Rules on prefill/decode (P/D) pairs: pd-* and side-channel-*.

P and D engines have kv and sit in proxy routes with the right role; each pair the proxy joins
agrees on what makes the handed-over KV usable (engine, version, model, dtypes, backend, block
size, connector, a tp layout the connector can transfer between); a NIXL side channel a decode
on another host dials is reachable and advertised as a routable address; a KV-aware vLLM route
can send prompts to its prefills at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from hgxserve.topology.engine_args import arg_value
from hgxserve.topology.model import Engine, Proxy, Topology, is_loopback
from hgxserve.topology.ports import UNSPECIFIED, setting_path, uses_nixl_side_channel
from hgxserve.topology.problems import JsonPath
from hgxserve.topology.registry import Finding, engine_rule, proxy_rule, rule
from hgxserve.topology.rules.common import at_least, cross_host, pd_pairs, show_version
from hgxserve.topology.wiring import proxy_protocol

FAMILY = ("pd-", "side-channel-")


# First vLLM release seen to pull a larger prefill TP into a smaller decode TP over NIXL (vLLM PR
# 27274, "Support P tensor-parallel-size > D tensor-parallel-size"): 0.32.0, run for real with
# prefill TP2 -> decode TP1 (docs/vllm-cpu.md). Older releases keep the stricter rule, whose
# assertion seed 000 §5.3.1 hit.
VLLM_NIXL_P_TP_GT_D = (0, 32, 0)
# Attention kinds whose KV is the same on every TP rank (MLA latent): nothing to split per head.
REPLICATED_KV = ("mla", "dsa", "csa")


def _fmt(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _pd_engines(topo: Topology) -> list[Engine]:
    return [e for e in topo.engines.values() if e.role in ("prefill", "decode")]


def _route_text(index: int | None) -> str:
    return f" (proxy.routes[{index}])" if index is not None else ""


@engine_rule(
    "pd-kv-required",
    "error",
    "Prefill and decode engines have kv; combined engines do not.",
    why="without kv a decode recomputes every prompt while looking healthy",
)
def pd_kv_required(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.role in ("prefill", "decode") and engine.kv is None:
        yield (
            ("engines", engine.name, "role"),
            f"a {engine.role} engine needs kv (e.g. kv: {{connector: nixl}}) to hand the KV "
            "cache over; without it decode recomputes every prompt",
        )
    elif engine.role == "combined" and engine.kv is not None:
        yield (
            setting_path(topo, engine.name, "kv"),
            "a combined engine serves whole requests and takes no kv; remove kv or make it "
            "a prefill or decode engine",
        )


def _listed(topo: Topology, at: JsonPath, name: str, role: str, only: str) -> Iterator[Finding]:
    """An engine the proxy lists at `at` exists and has the role the list is for."""
    target = topo.engines.get(name)
    if target is None:
        yield (at, f"unknown engine '{name}'; engines are: {', '.join(topo.engines)}")
    elif target.role != role:
        yield (at, f"{name} is a {target.role} engine; {only}")


def _proxy_members(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    for index, route in enumerate(proxy.routes):
        for side in ("prefill", "decode"):
            for j, name in enumerate(getattr(route, side)):
                at: JsonPath = ("proxy", "routes", index, side, j)
                only = f"routes[{index}].{side} lists {side} engines only"
                yield from _listed(topo, at, name, side, only)
    for j, name in enumerate(proxy.combined):
        only = "proxy.combined lists combined engines only (put P/D engines in proxy.routes)"
        yield from _listed(topo, ("proxy", "combined", j), name, "combined", only)


@rule(
    "pd-route",
    "error",
    "Every prefill/decode is in a proxy route with the right role; decodes have a prefill.",
    why=("an engine outside every route never gets traffic; a wrong role breaks the P/D protocol"),
)
def pd_route(topo: Topology) -> Iterator[Finding]:
    pd = _pd_engines(topo)
    proxy = topo.proxy
    if pd and proxy is None:
        names = ", ".join(e.name for e in pd)
        yield (
            ("engines", pd[0].name, "role"),
            f"P/D engines ({names}) need a proxy to pair them; add proxy: {{host: ..., routes: "
            "[{prefill: [...], decode: [...]}]}",
        )
    if not any(e.role == "prefill" for e in pd):
        for engine in pd:
            yield (
                ("engines", engine.name, "role"),
                f"decode engine {engine.name} has no prefill engine to take KV from; add a "
                "prefill engine (or make this one combined)",
            )
    if proxy is None:
        return
    yield from _proxy_members(topo, proxy)
    routed = {n for r in proxy.routes for n in (*r.prefill, *r.decode)}
    for engine in pd:
        if engine.name not in routed:
            yield (
                ("engines", engine.name, "role"),
                f"{engine.role} engine {engine.name} is in no proxy route; add it to "
                f"proxy.routes[].{engine.role} (requests would never reach it)",
            )


@rule(
    "pd-tp",
    "error",
    "vLLM NIXL: decode tp a multiple of prefill tp (vLLM >= 0.32: or a divisor of it).",
    why=(
        "vLLM NIXL: 'Local tensor parallel size 1 is not divisible by remote tensor parallel "
        "size 2' (seed 000 §5.3.1); vLLM 0.32 (PR 27274) pulls a larger prefill TP into a "
        "decode TP that divides it, unless the prefill TP exceeds the model's `kv_heads` "
        "(replicated KV, an assertion in the decode's handshake; MLA/DSA/CSA exempt): "
        "prefill TP2 -> decode TP1 ran for real ([vllm-cpu.md](vllm-cpu.md))"
    ),
)
def pd_tp(topo: Topology) -> Iterator[Finding]:
    for index, p, d in pd_pairs(topo):
        if p.engine != "vllm" or d.engine != "vllm":
            continue
        if d.tp >= p.tp and d.tp % p.tp == 0:
            continue
        where = setting_path(topo, d.name, "tp")
        if d.tp > p.tp or not at_least(d, VLLM_NIXL_P_TP_GT_D):
            shown = f"vLLM {d.version}" if d.version else "vLLM of an unstated version"
            newer = (
                f"; vLLM >= {show_version(VLLM_NIXL_P_TP_GT_D)} also takes a decode tp that "
                "divides the prefill's"
                if d.tp < p.tp
                else ""
            )
            yield (
                where,
                f"decode {d.name} tp {d.tp} must be >= prefill {p.name} tp {p.tp} and "
                f"divisible by it ({shown} NIXL: 'Local tensor parallel size {d.tp} is not "
                f"divisible by remote tensor parallel size {p.tp}'); use decode tp {p.tp} or "
                f"{p.tp * 2}{newer}{_route_text(index)}",
            )
            continue
        if p.tp % d.tp:
            yield (
                where,
                f"decode {d.name} tp {d.tp} must divide prefill {p.name} tp {p.tp} (vLLM NIXL: "
                f"'Remote tensor parallel size {p.tp} is not divisible by local tensor parallel "
                f"size {d.tp}'); use decode tp "
                + ", ".join(str(t) for t in range(1, p.tp) if p.tp % t == 0)
                + f", {p.tp} or {p.tp * 2}{_route_text(index)}",
            )
            continue
        arch = topo.model.architecture
        kv_heads = arch.kv_heads
        if arch.attention not in REPLICATED_KV and kv_heads and p.tp > kv_heads:
            yield (
                where,
                f"prefill {p.name} tp {p.tp} > the model's {kv_heads} KV heads replicates its "
                f"KV cache, and vLLM NIXL does not pull replicated KV into a smaller decode tp "
                f"(decode {d.name} tp {d.tp}: an AssertionError in the decode's handshake); "
                f"use decode tp >= {p.tp} or prefill tp <= {kv_heads}{_route_text(index)}",
            )


@rule(
    "pd-mooncake-equal-tp",
    "error",
    "Mooncake KV transfer needs equal prefill and decode tp.",
    why="Mooncake transfers KV only between equal TP layouts",
)
def pd_mooncake_equal_tp(topo: Topology) -> Iterator[Finding]:
    for index, p, d in pd_pairs(topo):
        connectors = {e.kv.connector for e in (p, d) if e.kv}
        if "mooncake" in connectors and p.tp != d.tp:
            yield (
                setting_path(topo, d.name, "tp"),
                f"mooncake transfers KV only between equal tensor-parallel layouts: decode "
                f"{d.name} tp {d.tp} != prefill {p.name} tp {p.tp}{_route_text(index)}; use "
                f"tp {p.tp} on both",
            )


_AGREE_ARGS = ("dtype", "kv_cache_dtype", "attention_backend", "speculative_config")


@rule(
    "pd-agree",
    "error",
    "P and D agree on engine, version, model, dtype, KV dtype, attention backend, speculative "
    "config, connector; prefill block size <= decode's.",
    why=(
        "different KV dtype/block size/attention backend/spec config make the handed-over KV "
        "unusable"
    ),
)
def pd_agree(topo: Topology) -> Iterator[Finding]:
    why = "P and D must agree or the KV handed over is unusable (decode recomputes or fails)"
    for index, p, d in pd_pairs(topo):
        where = _route_text(index)
        for key, pv, dv in (
            ("engine", p.engine, d.engine),
            ("version", p.version, d.version),
        ):
            if pv != dv:
                yield (
                    setting_path(topo, d.name, key),
                    f"decode {d.name} {key} {_fmt(dv)} differs from prefill {p.name} "
                    f"{_fmt(pv)}{where}; {why}",
                )
        p_model = p.extra_arg("--model", "--model-path") or topo.model.path
        d_model = d.extra_arg("--model", "--model-path") or topo.model.path
        if p_model != d_model:
            yield (
                setting_path(topo, d.name, "extra_args"),
                f"decode {d.name} serves model {d_model!r} but prefill {p.name} serves "
                f"{p_model!r}{where}; {why}",
            )
        for key in _AGREE_ARGS:
            p_arg, d_arg = arg_value(p.args, key), arg_value(d.args, key)
            if p_arg != d_arg:
                yield (
                    setting_path(topo, d.name, "args", key),
                    f"decode {d.name} {key} {_fmt(d_arg)} differs from prefill {p.name} "
                    f"{_fmt(p_arg)}{where}; {why}",
                )
        pc = p.kv.connector if p.kv else None
        dc = d.kv.connector if d.kv else None
        if pc and dc and pc != dc:
            yield (
                setting_path(topo, d.name, "kv", "connector"),
                f"decode {d.name} kv connector {dc} differs from prefill {p.name} {pc}{where}; "
                "both ends must use the same connector",
            )
        pb, db = p.args.get("block_size"), d.args.get("block_size")
        if (pb is None) != (db is None):
            yield (
                setting_path(topo, d.name, "args", "block_size"),
                f"block_size is {_fmt(pb)} on prefill {p.name} and {_fmt(db)} on decode "
                f"{d.name}{where}; set it on both (prefill block size <= decode block size)",
            )
        elif pb is not None and db is not None and pb > db:
            yield (
                setting_path(topo, d.name, "args", "block_size"),
                f"prefill {p.name} block_size {pb} must be <= decode {d.name} block_size "
                f"{db}{where}",
            )


def _dialed_side_channels(topo: Topology) -> Iterator[tuple[Engine, Engine]]:
    """(prefill, decode): each prefill whose NIXL side channel a decode on another host dials,
    with the first such decode (a finding on the prefill's side channel is made once)."""
    seen: set[str] = set()
    for _index, p, d in pd_pairs(topo):
        if p.name in seen or not uses_nixl_side_channel(p) or not cross_host(p, d):
            continue
        seen.add(p.name)
        yield p, d


@rule(
    "pd-side-channel-loopback",
    "error",
    "Cross-host P/D: the prefill's NIXL side channel is not on loopback.",
    why="seed 003 §11.3: handshake_setup_failed and ZMQ timeouts on all 8 TP ranks",
)
def pd_side_channel_loopback(topo: Topology) -> Iterator[Finding]:
    for p, d in _dialed_side_channels(topo):
        for host_name in p.hosts:
            if host_name not in topo.hosts:
                continue
            host = topo.hosts[host_name]
            written = p.kv.side_channel_host if p.kv else None
            # the pair crosses hosts, so 'auto' resolves to the host's side_channel_address
            address = host.side_channel_address if written in (None, "auto") else written
            if not is_loopback(address):
                continue
            path = (
                setting_path(topo, p.name, "kv", "side_channel", "host")
                if written not in (None, "auto")
                else ("hosts", host_name, "side_channel_address")
            )
            yield (
                path,
                f"NIXL side channel host {address} is loopback, but prefill {p.name} "
                f"({', '.join(p.hosts)}) and decode {d.name} ({', '.join(d.hosts)}) are on "
                "different hosts: decode cannot reach it (seed 003 §11.3: handshake_setup_failed "
                f"and ZMQ timeouts on every TP rank); use {host_name}'s routable address "
                f"({host.address}) or 'auto' (or omit host)",
            )
            break


@rule(
    "pd-side-channel-unspecified",
    "warning",
    "Cross-host P/D: a 0.0.0.0 side channel is advertised to decode as 0.0.0.0.",
    why="vLLM advertises the bind address as remote_host; 0.0.0.0 makes decode dial itself",
)
def pd_side_channel_unspecified(topo: Topology) -> Iterator[Finding]:
    for p, d in _dialed_side_channels(topo):
        written = p.kv.side_channel_host if p.kv else None
        if written in UNSPECIFIED:
            yield (
                setting_path(topo, p.name, "kv", "side_channel", "host"),
                f"side channel host {written} binds every interface, but vLLM also sends it to "
                f"decode {d.name} as remote_host, and decode then dials its own host; use 'auto' "
                "(each host's routable address)",
            )


@engine_rule(
    "side-channel-multi-host",
    "error",
    "A multi-host engine's side channel host is 'auto' (one address per host).",
    why="each host of a multi-host engine must advertise its own address",
)
def side_channel_multi_host(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not engine.is_multi_node or not uses_nixl_side_channel(engine):
        return
    written = engine.kv.side_channel_host if engine.kv else None
    if written in (None, "auto", *UNSPECIFIED):
        return
    yield (
        setting_path(topo, engine.name, "kv", "side_channel", "host"),
        f"{engine.name} runs DP ranks on {', '.join(engine.hosts)}, each advertising its "
        f"own host's side channel, but host {written} names one address; use 'auto' (each "
        "host's side_channel_address)",
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
    why=(
        "With `pd_remote_prefill_min_uncached_tokens` at or past the decodes' "
        "`max_model_len` every request is prefilled on its decode (`pd-local`): the prefills "
        "sit idle and the release gate sees no KV move"
    ),
)
def pd_remote_prefill_threshold(topo: Topology, proxy: Proxy) -> Iterator[Finding]:
    if proxy_protocol(topo) != "vllm-nixl":
        return  # SGLang routes always prefill on the prefill engine
    threshold = proxy.routing.pd_remote_prefill_min_uncached_tokens
    for index, route in enumerate(proxy.routes):
        if not proxy.kv_aware(route):
            continue
        shortest = topo.shortest_max_model_len(route.decode)
        if shortest is not None and threshold >= shortest[0]:
            yield (
                _threshold_path(topo),
                f"route {index} (policy {proxy.route_policy(route)}) sends a prompt to its "
                f"prefills only when at least {threshold} of its tokens are uncached on the "
                f"chosen decode, but its decodes take at most {shortest[0]} tokens "
                "(max_model_len): every request would prefill on its decode; lower "
                "proxy.routing.pd_remote_prefill_min_uncached_tokens below that",
            )
