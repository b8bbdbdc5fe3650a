"""Rules on where engines run: host-known, gpu-* and multi-host-gpu-kind.

Every host an engine or the proxy names exists; each GPU index exists on its host, is used by
one engine only, and the engine's tp x dp x pp matches the GPUs placed, whole DP ranks per host,
one GPU kind across a multi-host engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import Finding, engine_rule, rule

FAMILY = ("host-known", "gpu-", "multi-host-gpu-kind")


@rule(
    "host-known",
    "error",
    "Engines and the proxy only use hosts the topology defines.",
    why="a typo in a host name would deploy nothing (or to the wrong machine)",
)
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


@engine_rule(
    "gpu-index-range",
    "error",
    "GPU indices exist on the host (index < host gpus).",
    why="CUDA_VISIBLE_DEVICES with a missing index fails only at engine start",
)
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


@rule(
    "gpu-overlap",
    "error",
    "No GPU is used by two engines on one host.",
    why="two engines on one GPU OOM 10-20 minutes into start-up",
)
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
    "gpu-count",
    "error",
    "tp x dp x pp equals the GPUs placed; each host holds whole DP ranks.",
    why=("the engine refuses a world size that does not match its GPUs; TP stays inside a host"),
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


@engine_rule(
    "multi-host-gpu-kind",
    "error",
    "A multi-host engine uses one GPU kind on every host.",
    why="mixed GPU kinds in one NCCL world hang or run at the slowest kind",
)
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
