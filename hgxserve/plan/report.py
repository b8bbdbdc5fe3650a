"""Everything `hgxserve plan` shows, as plain data (its JSON output): per host the GPU map,
listeners and units (from the renderer), the P/D wiring, the firewall, the memory / KV-cache fit
estimate, the weights' trust root, and the last release's numbers against this topology.

    data = build_plan(load_topology("topologies/h20-v4flash-4p4d.yml"))
    data["hosts"]["h20-a"]["gpus"][0]   # {'index': 0, 'engine': 'prefill-0', 'role': 'prefill'}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hgxserve.render import render_topology
from hgxserve.topology.firewall import firewall_plan
from hgxserve.topology.model import S3Source, Topology
from hgxserve.topology.placement import proxy_tokenizer
from hgxserve.topology.ports import (
    bootstrap_address,
    engine_url,
    kv_event_endpoints,
    listeners_by_host,
    side_channel_host,
    side_channel_ports,
)

UNPINNED = (
    "the weights are not pinned: they are verified against the bucket's own manifest, so "
    "whoever can write the bucket chooses them; pin them with model.digest or the inventory's "
    "pins file (model_pins)"
)


def _render_units(topo: Topology) -> dict[str, list[dict[str, Any]]]:
    """Units per host, from the renderer (a RenderError propagates: `plan` then fails)."""
    units: dict[str, list[dict[str, Any]]] = {}
    for host, host_render in render_topology(topo).items():
        units[host] = [
            {
                "name": unit.name,
                "engine": unit.engine,
                "argv": list(unit.argv),
                "env": dict(unit.env),
            }
            for unit in host_render.units
        ]
    return units


def _model_source(topo: Topology) -> str:
    source = topo.model.source
    if isinstance(source, S3Source):
        return source.url + (f" at {source.endpoint}" if source.endpoint else "")
    if hasattr(source, "monitors"):
        return f"cephfs:{source.path}"
    return f"local:{source.path}"


def trust_plan(topo: Topology, inventory: str | None) -> tuple[dict[str, Any], list[str]]:
    """The model's trust root as plain data, and the refusals a deploy would make for it and
    for the topology's `{env: VAR}` secrets (only with the inventory, which holds the pins file
    and the allowed names)."""
    from hgxserve.topology.trust import (
        TrustError,
        env_refusals,
        inventory_trust,
        load_pins,
        trust_root,
        unpinned_refusal,
    )

    if inventory is None:
        root = trust_root(topo.model)
        data = {"kind": root.kind, "digest": root.digest, "where": root.where}
        if root.digest is None and topo.model.digest_from == "inventory":
            data["text"] = "the inventory's pins file (model_pins; give --inventory to see it)"
        return {**data, "text": data.get("text") or root.text()}, []
    from hgxserve.remote.inventory import InventoryError, load_inventory

    try:
        hosts = load_inventory(inventory).select(topo.hosts_in_use())
        pins_file, allowed = inventory_trust([h.data for h in hosts])
        root = trust_root(topo.model, load_pins(pins_file) if pins_file else {}, pins_file or "")
    except (InventoryError, TrustError) as exc:
        return {"kind": "error", "digest": None, "where": "", "text": str(exc)}, [str(exc)]
    refusals = env_refusals(topo, allowed)
    refusal = unpinned_refusal(topo, root)
    data = {"kind": root.kind, "digest": root.digest, "where": root.where, "text": root.text()}
    return data, refusals + ([refusal] if refusal else [])


def build_plan(topo: Topology) -> dict[str, Any]:
    """Everything `hgxserve plan` shows, as plain data (the JSON output).

    >>> build_plan(load_topology("topologies/h20-v4flash-4p4d.yml"))["hosts"]["h20-a"]["gpus"][0]
    ... # doctest: +SKIP
    {'index': 0, 'engine': 'prefill-0', 'role': 'prefill'}
    """
    listeners = listeners_by_host(topo)
    units = _render_units(topo)
    hosts: dict[str, Any] = {}
    for name in topo.hosts_in_use():
        host = topo.hosts[name]
        gpu_owner: dict[int, tuple[str, str]] = {}
        for engine in topo.engines_on(name):
            for gpu in engine.place[name]:
                gpu_owner.setdefault(gpu, (engine.name, engine.role))
        hosts[name] = {
            "address": host.address,
            "gpu": host.gpu,
            "gpu_count": host.gpus,
            "gpus": [
                {
                    "index": i,
                    "engine": gpu_owner[i][0] if i in gpu_owner else None,
                    "role": gpu_owner[i][1] if i in gpu_owner else None,
                }
                for i in range(host.gpus)
            ],
            "listeners": [
                {"port": li.port, "bind": li.bind, "owner": li.owner, "what": li.what}
                for li in sorted(listeners.get(name, []), key=lambda li: li.port)
            ],
            "units": units.get(name, []),
        }
    return {
        "topology": topo.name,
        "file": topo.source_file,
        "digest": topo.digest,
        "baseline": topo.baseline,
        "model": {
            "name": topo.model.name,
            "served_name": topo.model.served_name,
            "path": topo.model.path,
            "source": _model_source(topo),
            "integrity": topo.model.integrity,
        },
        "hosts": hosts,
        "wiring": _wiring(topo),
        "firewall": firewall_plan(topo),
        "fit": _fit(topo),
        # what the topology makes the hosts load on purpose (hgxserve.topology.rules.common)
        "accepted": {
            key: " ".join(str(why).split())
            for key, why in sorted((topo.raw.get("accept") or {}).items())
            if key.startswith("$")
        },
    }


def _fit(topo: Topology) -> dict[str, Any]:
    """The memory / KV-cache estimate per engine (hgxserve.topology.fit), as plain data."""
    from hgxserve.topology import fit

    try:
        facts, fits = fit.topology_fit(topo)
    except fit.ConfigError as exc:
        return {"config": topo.model.config, "error": str(exc), "engines": {}}
    if facts is None:
        return {"config": None, "error": "model.config not set: no estimate", "engines": {}}
    path = fit.config_path(topo)
    shown = os.path.relpath(path) if path and not os.path.relpath(path).startswith("..") else path
    return {
        "config": str(shown),
        "sources": facts.sources,
        "engines": {name: est.to_json() for name, est in fits.items()},
        "no_estimate": [n for n in topo.engines if n not in fits],
    }


def _engine_ref(topo: Topology, name: str) -> dict[str, Any]:
    engine = topo.engines.get(name)
    if engine is None:
        return {"name": name}
    ref: dict[str, Any] = {
        "name": name,
        "role": engine.role,
        "hosts": engine.hosts,
        "tp": engine.tp,
        "dp": engine.dp,
        "url": engine_url(topo, engine),
    }
    if engine.kv is not None:
        ref["kv"] = engine.kv.connector
        channels = [
            {
                "host": h,
                "dp_rank": rank,
                "address": side_channel_host(topo, engine, h),
                "port": port,
            }
            for h in engine.hosts
            if h in topo.hosts
            for rank, port in side_channel_ports(engine, h)
        ]
        if channels:
            ref["side_channels"] = channels
        if engine.engine == "sglang" and engine.role == "prefill":
            ref["bootstrap"] = f"{bootstrap_address(topo, engine)}:{engine.kv.bootstrap_port}"
    publishers, replays = kv_event_endpoints(topo, engine)
    if publishers:
        ref["kv_events"] = {"publishers": publishers, "replays": replays}
    return ref


def _routing(topo: Topology) -> dict[str, Any]:
    """The proxy's routing policy per route and where its tokenizer comes from."""
    proxy = topo.proxy
    assert proxy is not None
    tokenizer_dir, why = proxy_tokenizer(topo)
    return {
        "policy": proxy.routing.policy,
        "combined_policy": proxy.combined_route_policy,
        "route_policies": [proxy.route_policy(r) for r in proxy.routes],
        "tokenizer_dir": tokenizer_dir,
        "tokenizer": why,
    }


def _wiring(topo: Topology) -> dict[str, Any] | None:
    proxy = topo.proxy
    if proxy is None:
        return None
    return {
        "proxy": {
            "host": proxy.host,
            "listen": f"{proxy.listen_host}:{proxy.listen_port}",
            "kind": proxy.kind,
            "pd_min_prompt_tokens": proxy.pd_min_prompt_tokens,
            "auth": proxy.api_key is not None,
            "routing": _routing(topo) if proxy.kind == "hgxserve" else None,
        },
        "routes": [
            {
                "prefill": [_engine_ref(topo, n) for n in route.prefill],
                "decode": [_engine_ref(topo, n) for n in route.decode],
            }
            for route in proxy.routes
        ],
        "combined": [_engine_ref(topo, n) for n in proxy.combined],
    }


def last_release(topo: Topology, path: str) -> dict[str, Any]:
    """The engines' numbers kept by the last release (docs/releases.md "The engines' own
    numbers"), checked against this topology's shapes and fit estimate."""
    from hgxserve.bench.scenario import kv_shapes
    from hgxserve.release.kvcap import last_release as kv_last_release

    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a status report, bench run or release status")
    return {"from": path, "engines": kv_last_release(topo, doc, kv_shapes(topo.source_file))}
