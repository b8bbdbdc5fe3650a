"""Controller side: what one host's release is, from a validated topology and its render."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from hgxserve.base.digests import tree_digest
from hgxserve.release.evidence import unchecked_transport
from hgxserve.release.store import ReleaseSpec, UnitSpec
from hgxserve.render import credential_for, render_host
from hgxserve.render.proxy import drain_bound_s, proxy_drains
from hgxserve.topology import Topology
from hgxserve.topology.model import Engine, Proxy, SecretRef
from hgxserve.topology.ports import engine_url, proxy_url
from hgxserve.topology.wiring import METRICS_KEY_CREDENTIAL, proxy_key_credential, proxy_protocol


@dataclass
class HostRelease:
    """A host's release: its spec (release.json), the files of its tree, and the secrets the
    controller must push (as 0600 files) for the units' LoadCredential= lines."""

    host: str
    spec: ReleaseSpec
    files: dict[str, tuple[str, int]]
    secrets: dict[str, SecretRef] = field(default_factory=dict)  # host path -> reference

    @property
    def id(self) -> str:
        return self.spec.id


def _credential_source(ref: SecretRef) -> str:

    if ref.kind == "credential":
        return f"/etc/credstore/{ref.value}"
    _, line, path = credential_for("API_KEY", ref)
    return path or line.split(":", 1)[1]


def gate_host(topo: Topology) -> str | None:
    """The host that runs the topology-wide gate: `gate.from`, else the proxy's host."""
    if topo.proxy is None:
        return None
    return topo.gate.from_host or topo.proxy.host


def _enabled(setting: str, engines: list[Engine], *args: str) -> bool:
    if setting != "auto":
        return setting == "on"
    return any(all(e.args.get(a) for a in args) for e in engines)


def gate_prompt_words(topo: Topology, proxy: Proxy) -> int:
    """Words of the gate's P/D prompts: past the proxy's `pd_min_prompt_tokens` (an English word
    is >= 1 token), else 64, but short enough for the P/D engines' `max_model_len` (a word of an
    unknown tokenizer may take several tokens, ~1/16 of the context each, with filler and answer).

    >>> from hgxserve.topology import load_topology
    >>> topo = load_topology("topologies/demo/demo-vllm-cpu-pd.yml")  # max_model_len 256
    >>> gate_prompt_words(topo, topo.proxy)  # doctest: +SKIP
    16
    """
    shortest = topo.shortest_max_model_len(
        n for route in proxy.routes for n in (*route.prefill, *route.decode)
    )
    fits = (shortest[0] if shortest else 1 << 30) // 16
    return max(proxy.pd_min_prompt_tokens * 2, min(64, fits), _remote_prefill_words(topo, proxy))


def _remote_prefill_words(topo: Topology, proxy: Proxy) -> int:
    """Words that carry a probe past a KV-aware vLLM route's uncached-token threshold (under it
    the decode prefills locally, `pd-local`, and the gate would see no KV move); 0 otherwise.
    Rule pd-remote-prefill-threshold keeps the threshold below the decodes' max_model_len."""
    if proxy.kind != "hgxserve" or proxy_protocol(topo) != "vllm-nixl":
        return 0
    kv_aware = any(proxy.kv_aware(r) for r in proxy.routes)
    return proxy.routing.pd_remote_prefill_min_uncached_tokens + 1 if kv_aware else 0


def gate_spec(topo: Topology) -> dict[str, object] | None:
    proxy = topo.proxy
    host = gate_host(topo)
    if proxy is None or host is None:
        return None
    decode_metrics, prefill_metrics = [], []
    pd_engine = None

    def metrics(engine: Engine) -> str:
        return engine_url(topo, engine, from_host=host) + "/metrics"

    for route in proxy.routes:
        for name in route.decode:
            pd_engine = topo.engines[name].engine
            decode_metrics.append(metrics(topo.engines[name]))
        for name in route.prefill:
            prefill_metrics.append(metrics(topo.engines[name]))
    words = gate_prompt_words(topo, proxy)
    api_key_file = None
    if proxy.api_key is not None:
        # the gate runs as root on its host and reads the key where the unit loads it from
        api_key_file = _credential_source(proxy.api_key)
    gate = topo.gate
    served = [topo.engines[n] for n in proxy.combined] + [
        topo.engines[n] for r in proxy.routes for n in (*r.prefill, *r.decode)
    ]
    lengths = (["short"] if proxy.combined or not proxy.routes else []) + (
        ["long"] if proxy.routes else []
    )
    return {
        "proxy_url": proxy_url(topo, host),
        "served_name": topo.model.served_name,
        "api_key_file": api_key_file,
        "pd_engine": pd_engine if proxy.routes else None,
        "decode_metrics": sorted(set(decode_metrics)),
        "prefill_metrics": sorted(set(prefill_metrics)),
        "prompt_words": words if proxy.routes else 16,
        "kv_transport": unchecked_transport(topo),
        "timeout_s": float(gate.timeout_s),
        "probe": {
            "prompt": gate.prompt,
            "expect": gate.expect,
            "expect_regex": gate.expect_regex,
            "max_tokens": gate.max_tokens,
        },
        "lengths": lengths,
        "chat": gate.chat,
        "stream": gate.stream,
        "reasoning": _enabled(gate.reasoning, served, "reasoning_parser"),
        "tool_call": _enabled(
            gate.tool_call, served, "tool_call_parser", "enable_auto_tool_choice"
        ),
        # only when set: a release without a /metrics key keeps the id it always had
        **_metrics_key_file(proxy),
    }


def _metrics_key_file(proxy: Proxy) -> dict[str, str]:
    """The gate's `metrics_key_file` where the proxy's /metrics wants a key: read where the
    proxy's unit loads it from, as the API key is."""
    if proxy.metrics_key is None or proxy.kind != "hgxserve":
        return {}
    ref = proxy.metrics_key
    path = proxy_key_credential(ref, METRICS_KEY_CREDENTIAL)[2]  # env: where the role writes it
    return {"metrics_key_file": path or _credential_source(ref)}


def plan_release(
    topo: Topology, host: str, *, health_timeout_s: float | None = None
) -> HostRelease:
    """The release `host` gets for `topo` (an empty one when the topology leaves it unused)."""
    files: dict[str, tuple[str, int]] = {}
    units: list[UnitSpec] = []
    secrets: dict[str, SecretRef] = {}
    if host in topo.hosts_in_use():
        rendered = render_host(topo, host)
        files = rendered.tree
        secrets = {c.path: c.ref for c in rendered.credentials if c.path is not None}
        for unit in rendered.units:
            if unit.role == "watch":
                # its GET /state answers once it runs; started after the engines, stopped first
                url = f"http://127.0.0.1:{topo.engines[str(unit.engine)].watch_port}/state"
                units.append(UnitSpec(unit.name, "watch", url, []))
                continue
            if unit.engine is None:
                proxy = topo.proxy
                assert proxy is not None
                url = proxy_url(topo, proxy.host) + "/health"
                drain = drain_bound_s(topo) if proxy_drains(topo) else None
                units.append(UnitSpec(unit.name, "proxy", url, [], drain_s=drain))
                continue
            engine = topo.engines[unit.engine]
            if host == engine.head:
                url = engine_url(topo, engine, from_host=host) + "/health"
                units.append(
                    UnitSpec(unit.name, "engine", url, list(unit.gpus), engine.start_timeout_s)
                )
            else:
                units.append(UnitSpec(unit.name, "worker", None, list(unit.gpus)))
    gate = gate_spec(topo) if host == gate_host(topo) else None
    proxy = topo.proxy
    if gate and proxy and proxy.api_key and host != proxy.host and proxy.api_key.kind == "env":
        # `gate.from` another host: it needs the proxy's key where the gate reads it
        secrets[_credential_source(proxy.api_key)] = proxy.api_key
    if gate and proxy and "metrics_key_file" in gate and host != proxy.host:
        assert proxy.metrics_key is not None
        if proxy.metrics_key.kind == "env":
            secrets[str(gate["metrics_key_file"])] = proxy.metrics_key
    tree = tree_digest(files)
    identity = json.dumps(
        {
            "tree": tree,
            "units": [u.__dict__ for u in units],
            "gate": gate,
            "topology": topo.digest,
        },
        sort_keys=True,
    )
    release_id = hashlib.sha256(identity.encode()).hexdigest()[:12]
    spec = ReleaseSpec(
        id=release_id,
        topology=topo.name,
        topology_digest=topo.digest,
        baseline=topo.baseline,
        host=host,
        units=units,
        files={path: mode for path, (_, mode) in files.items()},
        health_timeout_s=health_timeout_s,
        gate=gate,
        tree_digest=tree,
    )
    return HostRelease(host, spec, files, secrets)


def switch_bound_s(plans: dict[str, HostRelease], overhead_s: float) -> int:
    """The longest any host of the run may take to switch: `overhead_s` (stopping the old
    units, waiting for their GPUs, starting the proxy) plus the proxy's drain bound plus its
    slowest engine's start (capped by `--data health_timeout`). A host that switched early
    keeps its dead-man timer beyond this, so it never reverts on its own while the others
    still start."""
    from hgxserve.release.switch import start_timeout

    longest = 0.0
    drain = 0.0
    for plan in plans.values():
        for unit in plan.spec.units:
            if unit.start_timeout_s is not None:
                longest = max(longest, start_timeout(unit, plan.spec.health_timeout_s))
            drain = max(drain, unit.drain_s or 0.0)
    return int(overhead_s + drain + longest) + 1
