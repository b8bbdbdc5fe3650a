"""An engine's cache bake as its unit runs it (`hgxserve cache bake`): the unit rendered for this
host, the cache key directory its cache variables share, the topology's warm-up shapes; then
the bake itself (`hgxserve.caches.bake`) and, when asked, the pack of what it left.

    >>> summary = bake_engine(topo, topo.engines["combined-0"], "h20-a",  # doctest: +SKIP
    ...                       BakeOptions(pack_to="/srv/caches/"))
    >>> summary["settled"], summary["archive"]["sha256"]  # doctest: +SKIP
    (True, '3f1c...')
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hgxserve.base.cachelayout import ENV_SUBDIRS
from hgxserve.base.errors import HgxserveError, UsageError
from hgxserve.caches.archive import mark_packed, pack_dir
from hgxserve.caches.bake import BakeSpec, bake
from hgxserve.caches.key import cache_key
from hgxserve.caches.warmup import Shape, warmup_plan
from hgxserve.render import render_host
from hgxserve.render.types import ENGINE_KEY_VAR
from hgxserve.topology.model import Engine, Topology


@dataclass(frozen=True)
class BakeOptions:
    """What `cache bake` takes besides the engine and host (its options, one field each)."""

    base_url: str | None = None  # default http://<the engine's bind or 127.0.0.1>:<port>
    host_facts: dict[str, Any] | None = None  # for the full key
    max_rounds: int = 4
    ready_timeout: float = 3600.0
    stop_timeout: float = 120.0
    log_path: str | None = None
    compile_deep_gemm: bool = True
    pack_to: str | None = None  # then pack the cache into this directory
    user: str | None = None  # the engine's User= (None: as the caller)


def bake_spec(topo: Topology, eng: Engine, host: str, opts: BakeOptions) -> BakeSpec:
    """The bake of `eng` on `host`: its unit's argv, environment and secrets, its cache key
    directory and the warm-up shapes. UsageError for an engine that spans hosts."""
    if eng.is_multi_node:
        raise UsageError(
            f"engine {eng.name} spans {len(eng.place)} hosts; bake a single-host engine with the "
            "same settings (a multi-node bake needs every node started together)"
        )
    units = render_host(topo, host).units
    unit = next((u for u in units if u.engine == eng.name), None)
    if unit is None:
        raise HgxserveError(f"no unit for engine {eng.name} on {host}")
    pinned = {unit.env[v] for v in ENV_SUBDIRS if v in unit.env}
    parents = {os.path.dirname(p) for p in pinned}
    if len(parents) != 1:
        raise HgxserveError(f"unit {unit.name}: cache variables do not share one key dir")
    cache_dir = parents.pop()
    max_len = eng.args.get("max_model_len")
    shapes = warmup_plan(
        [Shape(w.input, w.output, w.concurrency, w.api) for w in topo.warmup],
        int(max_len) if max_len else None,
    )
    bind = eng.bind if eng.bind and eng.bind not in ("0.0.0.0", "::") else "127.0.0.1"
    return BakeSpec(
        argv=list(unit.argv),
        env=dict(unit.env),
        cache_dir=cache_dir,
        base_url=opts.base_url or f"http://{bind}:{eng.port}",
        shapes=shapes,
        engine=eng.engine,
        key=os.path.basename(cache_dir),
        unit=unit.name,
        log_path=opts.log_path,
        ready_timeout=opts.ready_timeout,
        stop_timeout=opts.stop_timeout,
        max_rounds=opts.max_rounds,
        compile_deep_gemm=opts.compile_deep_gemm,
        model=topo.model.served_name,
        extra={
            "full_key": cache_key(topo, eng, host_facts=opts.host_facts),
            "host": host,
            "host_facts": opts.host_facts,
        },
        # the unit's secrets (a keyed engine's VLLM_API_KEY): the engine gets them as in its
        # unit, and the warm-up sends the key, or a keyed engine answers every shape 401
        secret_env=dict(unit.secret_env),
        api_key_var=ENGINE_KEY_VAR if ENGINE_KEY_VAR in unit.secret_env else None,
        user=opts.user,
    )


def bake_engine(topo: Topology, eng: Engine, host: str, opts: BakeOptions) -> dict[str, Any]:
    """Bake `eng`'s cache on `host` (and pack it with `opts.pack_to`): the summary `cache bake`
    prints (dir, full_key, settled, ready_seconds, rounds, log, archive)."""
    spec = bake_spec(topo, eng, host, opts)
    full_key = spec.extra["full_key"]
    record = bake(spec)
    summary: dict[str, Any] = {
        "dir": spec.cache_dir,
        "full_key": full_key,
        "settled": record["settled"],
        "ready_seconds": record["ready_seconds"],
        "rounds": [{k: r[k] for k in ("round", "requests", "jit_lines")} for r in record["rounds"]],
        "log": record["log"],
    }
    if opts.pack_to:
        pack_to = opts.pack_to
        packed = pack_dir(spec.cache_dir, pack_to if pack_to.endswith("/") else pack_to + "/")
        mark_packed(spec.cache_dir, packed, full_key=full_key)
        summary["archive"] = packed.as_dict()
    return summary
