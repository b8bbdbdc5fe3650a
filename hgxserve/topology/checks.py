"""The topology rules (DESIGN.md "Validation rules" 1-5), registered with `@rule` (`@engine_rule`
and `@proxy_rule` for a rule that looks at one engine, or at the proxy, at a time).

Each rule looks at one concern and yields (json path, message); the message says what is wrong
and what would be right, with the numbers. Findings on settings merged from `defaults` point at
the line where the user wrote them (`ports.setting_path`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from hgxserve.base.cachelayout import ENV_SUBDIRS
from hgxserve.base.digests import shipped_file_sha256
from hgxserve.base.paths import CONFIG_DIR, TOPOLOGY_FILES_DIR
from hgxserve.topology.engine_args import arg_of_flag
from hgxserve.topology.model import Engine, Proxy, Topology, is_loopback
from hgxserve.topology.ports import (
    KV_EVENTS,
    UNSPECIFIED,
    listeners_by_host,
    proxy_targets,
    setting_path,
    uses_nixl_side_channel,
    warmup_targets,
)
from hgxserve.topology.problems import JsonPath
from hgxserve.topology.registry import (
    ROUTERS,
    Finding,
    data_parallel,
    engine_rule,
    proxy_rule,
    rule,
)

HOPPER = ("H20", "H20-3e", "H100", "H800", "H200")
BLACKWELL = ("B200",)
# First vLLM release that certainly carries PR 32197 (--[no-]disable-nccl-for-dp-synchronization
# with async scheduling) and PR 32175 (MTP + P/D padding fix); both merged in January 2026.
VLLM_NCCL_DP_SYNC = (0, 15, 0)
VLLM_MTP_PD_FIX = (0, 15, 0)
# First vLLM release seen to pull a larger prefill TP into a smaller decode TP over NIXL (vLLM PR
# 27274, "Support P tensor-parallel-size > D tensor-parallel-size"): 0.32.0, run for real with
# prefill TP2 -> decode TP1 (docs/vllm-cpu.md). Older releases keep the stricter rule, whose
# assertion seed 000 §5.3.1 hit.
VLLM_NIXL_P_TP_GT_D = (0, 32, 0)
# Attention kinds whose KV is the same on every TP rank (MLA latent): nothing to split per head.
REPLICATED_KV = ("mla", "dsa", "csa")


def _version(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(g or 0) for g in match.groups())


def _show_version(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def _fmt(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _gpu_kinds(topo: Topology, engine: Engine) -> list[str]:
    """The GPU kinds of the (known) hosts an engine runs on, sorted."""
    return sorted({topo.hosts[h].gpu for h in engine.hosts if h in topo.hosts})


def _pd_engines(topo: Topology) -> list[Engine]:
    return [e for e in topo.engines.values() if e.role in ("prefill", "decode")]


def pd_pairs(topo: Topology) -> list[tuple[int | None, Engine, Engine]]:
    """(route index, prefill, decode) for every pair the proxy can join.

    Without proxy routes every prefill is paired with every decode (for the agreement rules).
    """
    pairs: list[tuple[int | None, Engine, Engine]] = []
    seen: set[tuple[str, str]] = set()
    engines = topo.engines
    if topo.proxy is not None and topo.proxy.routes:
        for index, route in enumerate(topo.proxy.routes):
            for p in route.prefill:
                for d in route.decode:
                    pe, de = engines.get(p), engines.get(d)
                    if pe is None or de is None or (p, d) in seen:
                        continue
                    if pe.role == "prefill" and de.role == "decode":
                        seen.add((p, d))
                        pairs.append((index, pe, de))
        return pairs
    for pe in engines.values():
        for de in engines.values():
            if pe.role == "prefill" and de.role == "decode":
                pairs.append((None, pe, de))
    return pairs


def _route_text(index: int | None) -> str:
    return f" (proxy.routes[{index}])" if index is not None else ""


def _cross_host(a: Engine, b: Engine) -> bool:
    return not (len(a.place) == 1 and a.hosts == b.hosts)


@rule(
    "monitoring-host",
    "error",
    "monitoring: Prometheus runs on a topology host; a container DCGM exporter names its image; "
    "the proxy's /metrics key is one the controller can hand Prometheus (env).",
)
def monitoring_host(topo: Topology) -> Iterator[Finding]:
    mon = topo.monitoring
    if mon is None:
        return
    if mon.prometheus_host is not None and mon.prometheus_host not in topo.hosts:
        yield (
            ("monitoring", "prometheus", "host"),
            f"unknown host '{mon.prometheus_host}'; define it under hosts "
            f"(hosts are: {', '.join(topo.hosts)})",
        )
    if mon.dcgm_exporter and mon.dcgm_source == "container" and mon.dcgm_image is None:
        yield (
            ("monitoring", "dcgm_exporter", "source"),
            "source: container needs image: (nvcr.io/nvidia/k8s/dcgm-exporter@sha256:<digest>)",
        )
    key = topo.proxy.metrics_key if topo.proxy else None
    if mon.prometheus_host is not None and key is not None and key.kind != "env":
        yield (
            ("proxy", "auth", "metrics_key"),
            f"Prometheus on {mon.prometheus_host} scrapes the proxy with this key, which the "
            f"controller pushes to it from its environment: use metrics_key: {{env: NAME}} "
            f"(not {key.kind}:), or drop monitoring.prometheus.host and give an existing "
            "Prometheus the key yourself (docs/monitoring.md)",
        )


# -- 1. GPUs -------------------------------------------------------------------------------------


@rule("host-known", "error", "Engines and the proxy only use hosts the topology defines.")
def host_known(topo: Topology) -> Iterator[Finding]:
    known = ", ".join(topo.hosts)
    for engine in topo.engines.values():
        for host in engine.place:
            if host not in topo.hosts:
                yield (
                    ("engines", engine.name, "place", host),
                    f"unknown host '{host}'; define it under hosts (hosts are: {known})",
                )
    if topo.proxy and topo.proxy.host not in topo.hosts:
        yield (
            ("proxy", "host"),
            f"unknown host '{topo.proxy.host}'; define it under hosts (hosts are: {known})",
        )


@engine_rule("gpu-index-range", "error", "GPU indices exist on the host (index < host gpus).")
def gpu_index_range(topo: Topology, engine: Engine) -> Iterator[Finding]:
    for host_name, gpus in engine.place.items():
        host = topo.hosts.get(host_name)
        if host is None:
            continue
        for i, gpu in enumerate(gpus):
            if gpu >= host.gpus:
                yield (
                    ("engines", engine.name, "place", host_name, i),
                    f"GPU {gpu} does not exist on {host_name}: it has {host.gpus} GPUs "
                    f"(indices 0-{host.gpus - 1})",
                )


@rule("gpu-overlap", "error", "No GPU is used by two engines on one host.")
def gpu_overlap(topo: Topology) -> Iterator[Finding]:
    owner: dict[tuple[str, int], str] = {}
    for engine in topo.engines.values():
        for host_name, gpus in engine.place.items():
            for i, gpu in enumerate(gpus):
                first = owner.setdefault((host_name, gpu), engine.name)
                if first != engine.name:
                    yield (
                        ("engines", engine.name, "place", host_name, i),
                        f"GPU {gpu} on {host_name} is already used by {first}; "
                        "give each engine its own GPUs",
                    )


@engine_rule(
    "gpu-count", "error", "tp x dp x pp equals the GPUs placed; each host holds whole DP ranks."
)
def gpu_count(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.dp_attention and engine.tp % engine.dp:
        return  # sglang-dp-attention reports it
    product = engine.world_size
    placed = engine.gpu_count
    if engine.dp_attention:
        formula = f"tp {engine.tp} (DP attention inside tp) x pp {engine.pp}"
    else:
        formula = f"tp {engine.tp} x dp {engine.dp} x pp {engine.pp}"
    if product != placed:
        yield (
            setting_path(topo, engine.name, "place"),
            f"{formula} = {product} GPUs, but {placed} are placed; place {product} GPUs "
            f"or change tp/dp/pp so that the product is {placed}",
        )
        return
    if not engine.is_multi_node:
        return
    per_rank = engine.gpus_per_dp_rank
    for host_name, gpus in engine.place.items():
        if len(gpus) % per_rank:
            yield (
                ("engines", engine.name, "place", host_name),
                f"{host_name} holds {len(gpus)} GPUs of {engine.name}, not a whole number of "
                f"DP ranks of {per_rank} GPUs (tp {engine.tp} x pp {engine.pp}); a "
                f"multi-host engine places a multiple of {per_rank} GPUs on each host "
                "(tensor parallelism stays inside one host; DP ranks spread over hosts)",
            )


@engine_rule("multi-host-gpu-kind", "error", "A multi-host engine uses one GPU kind on every host.")
def multi_host_gpu_kind(topo: Topology, engine: Engine) -> Iterator[Finding]:
    kinds = {h: topo.hosts[h].gpu for h in engine.hosts if h in topo.hosts}
    if len(set(kinds.values())) > 1:
        head_kind = kinds.get(engine.head)
        for host_name, kind in kinds.items():
            if kind != head_kind:
                yield (
                    ("engines", engine.name, "place", host_name),
                    f"{host_name} has {kind} GPUs but the head {engine.head} has "
                    f"{head_kind}; a multi-host engine needs the same GPU kind on every host",
                )


# -- 2. Ports ------------------------------------------------------------------------------------


@rule(
    "port-clash",
    "error",
    "No two listeners on one host share a port (HTTP, VLLM_PORT, side channel and KV events per "
    "DP rank, bootstrap, rpc, proxy, sshd).",
)
def port_clash(topo: Topology) -> Iterator[Finding]:
    for host_name, listeners in listeners_by_host(topo).items():
        first: dict[int, Any] = {}
        for listener in listeners:
            other = first.setdefault(listener.port, listener)
            if other is listener:
                continue
            yield (
                listener.path,
                f"port {listener.port} on {host_name} is used by both {other.label()} and "
                f"{listener.label()}; give each listener its own port{_kv_hint(other, listener)}",
            )


def _kv_hint(*listeners: Any) -> str:
    """Where KV-event ports come from, when one of the clashing listeners is one."""
    if not any(li.what.startswith(KV_EVENTS) for li in listeners):
        return ""
    return (
        " (KV-event ports are the engine's port + 20000 and + 21000 unless kv_events.port and "
        "kv_events.replay_port say otherwise, each + the DP rank)"
    )


MAX_PORT = 65535


@rule(
    "port-range",
    "error",
    "Every listener's port, derived ones included (side channel base + DP rank), is <= 65535.",
)
def port_range(topo: Topology) -> Iterator[Finding]:
    for host_name, listeners in listeners_by_host(topo).items():
        for listener in listeners:
            if not 0 < listener.port <= MAX_PORT:
                yield (
                    listener.path,
                    f"{listener.label()} on {host_name} would listen on port {listener.port}; "
                    f"ports end at {MAX_PORT}: lower the base port",
                )


# Environment the renderer derives from the topology: an `env:` entry would silently replace it
# and defeat the rules that checked the topology's own value (GPU overlap, loopback side
# channels, port clashes, offline hosts, cache keys).
TOPOLOGY_OWNED_ENV = {
    "CUDA_VISIBLE_DEVICES": "the engine's place (GPU indices)",
    "VLLM_PORT": "internal_port",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "kv.side_channel.host",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "kv.side_channel.port",
    "UCX_NET_DEVICES": "kv.ucx_devices",
    "UCX_TLS": "kv.ucx_tls",
    "VLLM_RPC_BASE_PATH": "the engine's run directory",
    "TMPDIR": "the engine's run directory",
    "XDG_CACHE_HOME": "the engine's run directory",
    "HF_HOME": "the engine's run directory",
    "HF_HUB_OFFLINE": "hgxserve (hosts never download)",
    "TRANSFORMERS_OFFLINE": "hgxserve (hosts never download)",
    "VLLM_HOST_IP": "the host's address",
    **{var: "cache.root and the cache key" for var in ENV_SUBDIRS},
}


@rule(
    "env-owned",
    "error",
    "env and secret_env do not set what the topology owns (GPUs, ports, side channel, caches).",
)
def env_owned(topo: Topology) -> Iterator[Finding]:
    places: list[tuple[tuple[str, ...], Any]] = [(("defaults",), topo.raw.get("defaults", {}))]
    places += [(("engines", n), d) for n, d in topo.raw.get("engines", {}).items()]
    for base, data in places:
        for section in ("env", "secret_env"):
            for key in (data or {}).get(section, {}) or {}:
                owner = TOPOLOGY_OWNED_ENV.get(key)
                if owner is not None:
                    yield (
                        (*base, section, key),
                        f"{key} is rendered from {owner}; remove this {section} entry (it "
                        "would replace the value the rules checked) and set that instead",
                    )


@engine_rule(
    "remote-code-integrity",
    "error",
    "trust_remote_code runs Python from the model tree: only with sha256-verified weights.",
)
def remote_code_integrity(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if topo.model.integrity == "sha256":
        return
    if engine.args.get("trust_remote_code"):
        yield (
            setting_path(topo, engine.name, "args", "trust_remote_code"),
            "trust_remote_code runs Python from the model tree inside the engine; "
            "with model.integrity: size-etag nothing proves those files are the published "
            "ones: publish a manifest and drop the opt-out, or turn trust_remote_code off",
        )


@engine_rule(
    "remote-code-pin",
    "error",
    "trust_remote_code needs pinned weights: model.digest, or digest_from: inventory.",
)
def remote_code_pin(topo: Topology, engine: Engine) -> Iterator[Finding]:
    model = topo.model
    if model.integrity != "sha256" or model.digest or model.digest_from == "inventory":
        return  # the opt-out is rule remote-code-integrity's
    if engine.args.get("trust_remote_code"):
        yield (
            setting_path(topo, engine.name, "args", "trust_remote_code"),
            "trust_remote_code runs Python from the model tree, and without a pin the weights "
            "are verified only against the bucket's own manifest: whoever can write the bucket "
            "runs code on every host; pin the manifest digest (model.digest: sha256:..., from "
            "`hgxserve weights manifest SRC`) or keep the pin in the inventory's pins file "
            "(model.digest_from: inventory)",
        )


# -- 3. P/D --------------------------------------------------------------------------------------


@engine_rule(
    "pd-kv-required", "error", "Prefill and decode engines have kv; combined engines do not."
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


@proxy_rule(
    "proxy-targets", "error", "The proxy routes somewhere; a prompt-length split has both sides."
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
    "proxy-combined-unlisted", "warning", "Combined engines are reachable through the proxy."
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
    "proxy-kind", "error", "The router kind matches the engines' P/D protocol.", kinds=ROUTERS
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


@rule(
    "pd-tp",
    "error",
    "vLLM NIXL: decode tp a multiple of prefill tp (vLLM >= 0.32: or a divisor of it).",
)
def pd_tp(topo: Topology) -> Iterator[Finding]:
    for index, p, d in pd_pairs(topo):
        if p.engine != "vllm" or d.engine != "vllm":
            continue
        if d.tp >= p.tp and d.tp % p.tp == 0:
            continue
        where = setting_path(topo, d.name, "tp")
        version = _version(d.version)
        if d.tp > p.tp or version is None or version < VLLM_NIXL_P_TP_GT_D:
            shown = f"vLLM {d.version}" if d.version else "vLLM of an unstated version"
            newer = (
                f"; vLLM >= {_show_version(VLLM_NIXL_P_TP_GT_D)} also takes a decode tp that "
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


@rule("pd-mooncake-equal-tp", "error", "Mooncake KV transfer needs equal prefill and decode tp.")
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


def _override(engine: Engine, *flags: str) -> str | None:
    """Value an extra_args flag sets (`--flag v` or `--flag=v`), if any."""
    args = engine.extra_args
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


_AGREE_ARGS = ("dtype", "kv_cache_dtype", "attention_backend", "speculative_config")


@rule(
    "pd-agree",
    "error",
    "P and D agree on engine, version, model, dtype, KV dtype, attention backend, speculative "
    "config, connector; prefill block size <= decode's.",
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
        p_model = _override(p, "--model", "--model-path") or topo.model.path
        d_model = _override(d, "--model", "--model-path") or topo.model.path
        if p_model != d_model:
            yield (
                setting_path(topo, d.name, "extra_args"),
                f"decode {d.name} serves model {d_model!r} but prefill {p.name} serves "
                f"{p_model!r}{where}; {why}",
            )
        for key in _AGREE_ARGS:
            pv, dv = p.args.get(key), d.args.get(key)
            if pv != dv:
                yield (
                    setting_path(topo, d.name, "args", key),
                    f"decode {d.name} {key} {_fmt(dv)} differs from prefill {p.name} "
                    f"{_fmt(pv)}{where}; {why}",
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
        if p.name in seen or not uses_nixl_side_channel(p) or not _cross_host(p, d):
            continue
        seen.add(p.name)
        yield p, d


@rule(
    "pd-side-channel-loopback",
    "error",
    "Cross-host P/D: the prefill's NIXL side channel is not on loopback.",
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


# -- 4. Attention heads --------------------------------------------------------------------------


@engine_rule(
    "heads-per-rank",
    "warning",
    "DSA (FlashMLA-sparse): heads per TP rank a multiple of 64 on Hopper, 128 on Blackwell.",
)
def heads_per_rank(topo: Topology, engine: Engine) -> Iterator[Finding]:
    arch = topo.model.architecture
    heads = arch.attention_heads
    if arch.attention != "dsa" or not heads:
        return
    kinds = _gpu_kinds(topo, engine)
    if not kinds:
        return
    granule = 128 if any(k in BLACKWELL for k in kinds) else 64
    if not any(k in HOPPER + BLACKWELL for k in kinds):
        return
    attention_tp = engine.tp
    note = ""
    if engine.engine == "sglang" and engine.args.get("enable_dp_attention") and engine.dp > 1:
        attention_tp = max(1, engine.tp // engine.dp)
        note = f" (DP attention: tp {engine.tp} / dp {engine.dp})"
    per_rank = heads // attention_tp
    if heads % attention_tp == 0 and per_rank % granule == 0:
        return
    yield (
        setting_path(topo, engine.name, "tp"),
        f"{heads} attention heads / tp {attention_tp}{note} = {per_rank} heads per rank; "
        f"FlashMLA-sparse (DSA) on {'/'.join(kinds)} computes heads per rank in multiples of "
        f"{granule}, so each rank pads to {granule} and wastes work (seed 000 §4.4.2: "
        f"DeepSeek V3.2 128 heads -> TP in {{1, 2}} on Hopper); "
        + _heads_advice(topo, engine, heads, granule),
    )


def _heads_advice(topo: Topology, engine: Engine, heads: int, granule: int) -> str:
    """Which tp to use instead: only sizes that divide the heads into whole granules, fit on
    one host, and hold the weights (with expert parallelism where that is what makes them fit)."""
    from hgxserve.topology import fit

    host_gpus = min((topo.hosts[h].gpus for h in engine.hosts if h in topo.hosts), default=8)
    sizes = [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= host_gpus and heads % t == 0 and (heads // t) % granule == 0
    ]
    try:
        facts = fit.model_facts(topo)
    except fit.ConfigError:
        facts = None
    estimate = fit.engine_fit(topo, engine, facts) if facts else None
    if not sizes:
        return "no tp divides the heads into whole multiples; keep the padding"
    if facts is None or estimate is None:
        return _heads_advice_by_size(topo, engine, sizes)
    plain, with_ep = [], []
    for t in sizes:
        if fit.weights_per_gpu(facts, engine, tp=t, ep=engine.ep) <= estimate.budget:
            plain.append(t)
        elif not engine.ep and fit.weights_per_gpu(facts, engine, tp=t, ep=True) <= estimate.budget:
            with_ep.append(t)
    if plain:
        return "use tp in {" + ", ".join(map(str, plain)) + "} with dp for more GPUs"
    if with_ep:
        return (
            "use tp in {" + ", ".join(map(str, with_ep)) + "} with dp and ep: true (at those "
            "sizes only expert parallelism makes the weights fit)"
        )
    return (
        "no tp with whole multiples holds the weights on these GPUs "
        f"(tried {', '.join(map(str, sizes)) or 'none'}); keep tp {engine.tp} and the padding"
    )


def _heads_advice_by_size(topo: Topology, engine: Engine, sizes: list[int]) -> str:
    """Advice without a model config: the model's size over tp must fit a GPU's budget."""
    from hgxserve.topology import fit

    listed = "{" + ", ".join(map(str, sizes)) + "}"
    gpu = topo.hosts[engine.head].gpu if engine.head in topo.hosts else None
    size = topo.model.size
    if size is None or gpu not in fit.GPU_MEMORY_MIB:
        return (
            f"use tp in {listed} with dp for more GPUs if the weights fit at that tp (set "
            "model.config or model.size to have that checked)"
        )
    budget = (
        fit.GPU_MEMORY_MIB[gpu]
        * fit.MIB
        * float(engine.args.get("gpu_memory_utilization", fit.DEFAULT_UTILIZATION))
    )
    fitting = [t for t in sizes if size / t <= budget]
    if fitting:
        return "use tp in {" + ", ".join(map(str, fitting)) + "} with dp for more GPUs"
    return (
        f"no tp in {listed} holds the model's {fit.gib(size)} GiB on one {gpu}; keep tp "
        f"{engine.tp} and the padding (or set model.config to check tp with ep: true)"
    )


# -- 5. Known-bad combinations -------------------------------------------------------------------


@engine_rule("eplb-log-balancedness", "warning", "EPLB log_balancedness is off where decode runs.")
def eplb_log_balancedness(topo: Topology, engine: Engine) -> Iterator[Finding]:
    eplb = engine.args.get("eplb_config") or {}
    if engine.role in ("decode", "combined") and eplb.get("log_balancedness") is True:
        yield (
            setting_path(topo, engine.name, "args", "eplb_config", "log_balancedness"),
            "EPLB log_balancedness copies expert load from GPU to host every step (24 ms "
            "eplb-step): seed 000 §5.3.2 measured decode output 4969.65 tok/s without EPLB "
            "and 1618.92 tok/s with it, 5339.16 after the fix; set log_balancedness: false",
        )


@engine_rule(
    "async-scheduling-dp",
    "warning",
    "Keep async scheduling with DP; use disable_nccl_for_dp_synchronization: false instead.",
    engine="vllm",
    when=data_parallel,
)
def async_scheduling_dp(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.args.get("async_scheduling") is not False:
        return
    version = _version(engine.version)
    if version is not None and version < VLLM_NCCL_DP_SYNC:
        return
    yield (
        setting_path(topo, engine.name, "args", "async_scheduling"),
        "async_scheduling: false (--no-async-scheduling) drops the async scheduler; on vLLM "
        f">= {_show_version(VLLM_NCCL_DP_SYNC)} (PR 32197) keep it and set "
        "disable_nccl_for_dp_synchronization: false (--no-disable-nccl-for-dp-"
        "synchronization) so DP padding syncs over NCCL (seed 000 §4.4.1: 9 ms -> 1 ms in "
        "coordinate_batch_across_dp)",
    )


@engine_rule(
    "mtp-pd-version",
    "warning",
    "Speculative decoding with P/D needs vLLM with PR 32175.",
    engine="vllm",
)
def mtp_pd_version(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.role not in ("prefill", "decode"):
        return
    if not engine.args.get("speculative_config"):
        return
    version = _version(engine.version)
    if version is not None and version >= VLLM_MTP_PD_FIX:
        return
    shown = f"version {engine.version}" if engine.version else "an unstated version"
    yield (
        setting_path(topo, engine.name, "args", "speculative_config"),
        f"MTP/speculative decoding with P/D on vLLM {shown}: before PR 32175 requests "
        "without draft results broke padding (seed 000 §5.3.3: 'Invalid reshape for "
        "topk_indices', fp8_paged_mqa_logits batch size assertion); use vLLM >= "
        f"{_show_version(VLLM_MTP_PD_FIX)} and set version",
    )


@engine_rule(
    "ray-single-node",
    "warning",
    "Single-host vLLM engines use the mp executor, not ray.",
    engine="vllm",
)
def ray_single_node(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if engine.is_multi_node:
        return
    if engine.args.get("distributed_executor_backend") == "ray":
        yield (
            setting_path(topo, engine.name, "args", "distributed_executor_backend"),
            "the ray executor on a single-host engine produced garbage tokens (random "
            "Chinese/English and symbols) with /health 200 in seed 003 §11.3; use "
            "distributed_executor_backend: mp when the engine fits on one host",
        )


@engine_rule("max-num-seqs-unset", "warning", "max_num_seqs is set (bounds CUDA-graph capture).")
def max_num_seqs_unset(topo: Topology, engine: Engine) -> Iterator[Finding]:
    peak = max((w.concurrency for w in topo.warmup), default=None)
    hint = f" (the largest warmup concurrency is {peak})" if peak else ""
    if "max_num_seqs" in engine.args or engine.args.get("enforce_eager"):
        return
    yield (
        setting_path(topo, engine.name, "args"),
        "max_num_seqs is not set: the engine default captures CUDA graphs for batch shapes "
        "never used and lengthens every cold start (seed 003 §5, §12.2: 51 shapes in 394 s); "
        f"set args.max_num_seqs to the concurrency you serve{hint}",
    )


@engine_rule(
    "sglang-health-generation",
    "warning",
    "SGLang /health does not generate (it pollutes load tests and P/D).",
    engine="sglang",
)
def sglang_health_generation(topo: Topology, engine: Engine) -> Iterator[Finding]:
    value = engine.env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
    if value is None or value.lower() in ("0", "false", "no", "off", ""):
        return
    extra = (
        "; on a P/D engine a generating probe also needs its peer and can hang"
        if engine.role != "combined"
        else ""
    )
    yield (
        setting_path(topo, engine.name, "env", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"),
        "a generative /health runs a real prefill on every probe (seed 003 §12.4: a "
        f"256-token prefill every 10 s polluted TTFT and throughput){extra}; set it to 0 "
        "(the hgxserve default)",
    )


@engine_rule(
    "served-name", "error", "Every engine the proxy routes to serves the model's served_name."
)
def served_name(topo: Topology, engine: Engine) -> Iterator[Finding]:
    targets = proxy_targets(topo)
    name = _override(engine, "--served-model-name")
    if name is None or name == topo.model.served_name:
        return
    routed = " the proxy routes it requests for" if engine.name in targets else " clients ask"
    yield (
        setting_path(topo, engine.name, "extra_args"),
        f"{engine.name} serves '{name}' (--served-model-name in extra_args) but{routed} "
        f"'{topo.model.served_name}' (model.served_name); remove the flag",
    )


# flags the renderer writes from typed fields; repeating them in extra_args bypasses the rules
_TYPED_FLAGS = {
    "--port": "port",
    "--host": "bind",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--tp-size": "tp",
    "--tp": "tp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
    "--dp-size": "dp",
    "--dp": "dp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--pp-size": "pp",
    "--enable-expert-parallel": "ep",
    "--ep-size": "ep",
    "--kv-transfer-config": "kv",
    "--disaggregation-mode": "role",
    "--disaggregation-bootstrap-port": "kv.bootstrap_port",
    "--data-parallel-rpc-port": "rpc_port",
    # every flag the renderers write for a typed arg (the one table, ARG_FLAGS)
    **{name: f"args.{key}" for name, key in arg_of_flag().items()},
}


@rule("extra-args-typed", "error", "extra_args do not repeat flags that typed fields render.")
def extra_args_typed(topo: Topology) -> Iterator[Finding]:
    sources: list[tuple[tuple[str | int, ...], list[Any]]] = []
    defaults = topo.raw.get("defaults", {})
    sources.append((("defaults", "extra_args"), defaults.get("extra_args", [])))
    for name, data in topo.raw.get("engines", {}).items():
        sources.append((("engines", name, "extra_args"), data.get("extra_args", [])))
    for base, args in sources:
        for i, arg in enumerate(args):
            if not isinstance(arg, str):
                continue
            flag = arg.split("=", 1)[0]
            field = _TYPED_FLAGS.get(flag)
            if field:
                yield (
                    (*base, i),
                    f"{flag} in extra_args duplicates the typed field {field}; set {field} "
                    "instead (extra_args bypass the P/D, GPU and port checks)",
                )


@rule("warmup-max-model-len", "error", "Warm-up input + output fits the engines' max_model_len.")
def warmup_max_model_len(topo: Topology) -> Iterator[Finding]:
    for index, shape in enumerate(topo.warmup):
        names = warmup_targets(topo, shape)
        total = shape.input + shape.output
        limits = [
            (topo.engines[n].args["max_model_len"], n)
            for n in names
            if n in topo.engines and "max_model_len" in topo.engines[n].args
        ]
        if not limits:
            continue
        limit, name = min(limits)
        if total > limit:
            yield (
                ("warmup", index),
                f"input {shape.input} + output {shape.output} = {total} tokens exceeds "
                f"max_model_len {limit} of {name}; the warm-up request would be rejected: "
                f"shorten the shape to at most {limit} tokens or raise max_model_len",
            )


# Words that mark a name as holding a secret (words, not substrings: TOKENIZERS_PARALLELISM is
# not a token). TOKEN and KEY also name counts and sizes: followed by one of _QUANTITY_WORDS they
# do not count (vLLM's VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD and
# VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD are token counts, vllm/envs.py). SECRET, PASSWORD and
# CREDENTIAL always count; so does a TOKEN or KEY followed by anything else (HF_TOKEN,
# HF_TOKEN_2, API_KEY_PROD).
_SECRET_WORDS = {"SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
_SECRET_IF_NOT_COUNTED = {"KEY", "KEYS", "APIKEY", "TOKEN"}
_QUANTITY_WORDS = {
    "THRESHOLD",
    "THRESHOLDS",
    "LIMIT",
    "BUDGET",
    "COUNT",
    "NUM",
    "SIZE",
    "LEN",
    "LENGTH",
    "MAX",
    "MIN",
    "RATIO",
    "PER",
    "INTERVAL",
    "SECONDS",
    "SECS",
    "MS",
    "TIMEOUT",
    "RATE",
    "USAGE",
    "IDS",
}
# words that mark a variable holding a location or a switch, not the secret itself
_NOT_SECRET_WORDS = {"FILE", "PATH", "DIR", "ID", "ENABLE", "ENABLED", "DISABLE"}
_SECRET_FLAGS = ("--api-key", "--hf-token")


def _secret_key(key: str) -> bool:
    """Whether an env name looks like it holds a secret.

    >>> [_secret_key(k) for k in ("HF_TOKEN", "VLLM_API_KEY", "AWS_SECRET_ACCESS_KEY",
    ...     "HF_TOKEN_2")]
    [True, True, True, True]
    >>> [_secret_key(k) for k in ("TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH",
    ...     "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD", "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE")]
    [False, False, False, False]
    """
    words = [w for w in re.split(r"[^A-Za-z0-9]+", key.upper()) if w]
    if set(words) & _NOT_SECRET_WORDS:
        return False
    if set(words) & _SECRET_WORDS:
        return True
    return any(
        word in _SECRET_IF_NOT_COUNTED
        and (i + 1 == len(words) or words[i + 1] not in _QUANTITY_WORDS)
        for i, word in enumerate(words)
    )


@rule("secret-env", "error", "No secret values in env or extra_args; use secret_env references.")
def secret_env(topo: Topology) -> Iterator[Finding]:
    places: list[tuple[tuple[str, ...], dict[str, Any], list[Any]]] = []
    defaults = topo.raw.get("defaults", {})
    places.append((("defaults",), defaults.get("env", {}), defaults.get("extra_args", [])))
    for name, data in topo.raw.get("engines", {}).items():
        places.append((("engines", name), data.get("env", {}), data.get("extra_args", [])))
    for base, env, extra in places:
        for key, value in env.items():
            if _secret_key(key) and str(value) != "":
                yield (
                    (*base, "env", key),
                    f"env {key} looks like a secret: a value here lands in the unit file and "
                    f"`systemctl show`; use secret_env with a reference, e.g. secret_env: "
                    f"{{{key}: {{env: {key}}}}} or {{file: {CONFIG_DIR}/{key.lower()}}}",
                )
        for i, arg in enumerate(extra):
            if isinstance(arg, str) and arg.split("=", 1)[0] in _SECRET_FLAGS:
                yield (
                    (*base, "extra_args", i),
                    f"{arg.split('=', 1)[0]} puts a secret on the command line (visible in ps "
                    "and the unit); use secret_env with a reference (e.g. VLLM_API_KEY: "
                    "{env: VLLM_API_KEY}) or proxy.auth",
                )


@engine_rule(
    "sglang-dp-attention", "error", "SGLang DP attention needs dp > 1 dividing tp.", engine="sglang"
)
def sglang_dp_attention(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not engine.args.get("enable_dp_attention"):
        return
    if engine.dp < 2 or engine.tp % engine.dp:
        yield (
            setting_path(topo, engine.name, "dp"),
            f"enable_dp_attention splits tp {engine.tp} into dp attention groups: dp must be "
            f"> 1 and divide tp, got dp {engine.dp} (seed 002: --tp-size 8 --dp-size 8 "
            "--enable-dp-attention)",
        )


@rule("file-source", "error", "Every file under files: exists on the controller with its sha256.")
def file_source(topo: Topology) -> Iterator[Finding]:
    for name, spec in topo.files.items():
        if spec.is_url:
            continue  # fetched by the controller at deploy time and checked against sha256
        written = topo.raw.get("files", {}).get(name, {}).get("source", spec.source)
        try:
            actual = shipped_file_sha256(spec.source)
        except OSError as exc:
            yield (
                ("files", name, "source"),
                f"cannot read {written}: {exc.strerror or exc}; the runtime stage ships this "
                "file to the hosts (a path relative to the topology file, or absolute)",
            )
            continue
        if actual != spec.sha256:
            yield (
                ("files", name, "sha256"),
                f"{written} has sha256 {actual}, not {spec.sha256}: set sha256: {actual} "
                "if the new content is intended",
            )


def _setting_or_arg_path(topo: Topology, engine: Engine, keys: tuple[str, ...]) -> JsonPath:
    if keys[0] != "extra_args":
        return setting_path(topo, engine.name, *keys)
    index = int(keys[1])  # merged extra_args: the defaults' first, then the engine's own
    inherited = len(topo.raw.get("defaults", {}).get("extra_args", []))
    if index < inherited:
        return ("defaults", "extra_args", index)
    return ("engines", engine.name, "extra_args", index - inherited)


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/")


@engine_rule(
    "engine-path-provided",
    "error",
    "A host path an engine arg names is provided: a topology file, the model, the runtime.",
)
def engine_path_provided(topo: Topology, engine: Engine) -> Iterator[Finding]:
    shipped = {spec.host_path: name for name, spec in topo.files.items()}
    roots = [topo.model.path, topo.cache.root]
    if engine.runtime is not None and engine.runtime.venv:
        roots.append(engine.runtime.venv)
    for keys, flag, path in engine.host_paths():
        if path in shipped or any(_under(path, root) for root in roots):
            continue
        name = path.rsplit("/", 1)[-1] or "file"
        yield (
            _setting_or_arg_path(topo, engine, keys),
            f"{flag} points at {path}, which nothing provides on the hosts: add it under "
            f"files: (e.g. files: {{{name}: {{source: ..., sha256: ...}}}}) and point at "
            f"{TOPOLOGY_FILES_DIR}/{name}, or use a path inside the model "
            f"({topo.model.path}) or the runtime",
        )


@rule(
    "gate-rdma-tcp",
    "warning",
    "Cross-host NIXL P/D whose kv.ucx_tls names no RDMA transport fails the gate's RDMA check.",
)
def gate_rdma_over_tcp(topo: Topology) -> Iterator[Finding]:
    if topo.gate.rdma == "off":
        return
    reported: set[str] = set()
    for _index, p, d in pd_pairs(topo):
        if not _cross_host(p, d):
            continue
        for engine in (p, d):
            kv = engine.kv
            if engine.name in reported or kv is None or not kv.ucx_tcp_only:
                continue
            reported.add(engine.name)
            yield (
                setting_path(topo, engine.name, "kv", "ucx_tls"),
                f"UCX_TLS={','.join(kv.ucx_tls or ())} names no RDMA transport: KV between "
                f"{p.name} ({', '.join(p.hosts)}) and {d.name} ({', '.join(d.hosts)}) can only "
                "go over TCP, and the gate's RDMA check (gate.rdma: auto) fails every release; "
                "add an RDMA transport (e.g. rc) or, where the hosts have no RDMA NIC, set "
                "gate.rdma: off (the deploy then says the KV went over TCP)",
            )


@rule("gate", "error", "The gate's regex compiles, its host exists, its probes can run.")
def gate_settings(topo: Topology) -> Iterator[Finding]:
    gate = topo.gate
    if gate.expect_regex is not None:
        try:
            re.compile(gate.expect_regex)
        except re.error as exc:
            yield ("gate", "expect_regex"), f"not a valid regular expression: {exc}"
    if gate.from_host is not None and gate.from_host not in topo.hosts:
        known = ", ".join(topo.hosts)
        yield (
            ("gate", "from"),
            f"unknown host '{gate.from_host}'; define it under hosts (hosts are: {known})",
        )
    if gate.from_host is not None and topo.proxy is None:
        yield ("gate", "from"), "the gate runs through the proxy: this topology has none"
    if gate.bench is not None:
        names = [s.get("name") for s in (topo.raw.get("bench") or {}).get("scenarios") or []]
        if topo.proxy is None:
            yield ("gate", "bench"), "the bench runs through the proxy: this topology has none"
        elif gate.bench.scenario not in names:
            yield (
                ("gate", "bench", "scenario"),
                f"no scenario '{gate.bench.scenario}' in this topology's bench: section "
                f"(scenarios: {', '.join(map(str, names)) or 'none'}); the release's SLA lives "
                "in the topology itself, not in a bench file beside it",
            )
    for key, arg in (("reasoning", "reasoning_parser"), ("tool_call", "tool_call_parser")):
        if getattr(gate, key) == "on" and not any(e.args.get(arg) for e in topo.engines.values()):
            yield (
                ("gate", key),
                f"the {key} probe is on but no engine sets args.{arg}: it would always fail",
            )
