"""Facts derived from engine args, defined once on the typed model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]


def test_shortest_max_model_len_names_the_engine_and_skips_unknown_or_unset():
    topo = load_topology(REPO / "topologies/h200-dsv32-2p1d.yml")
    names = sorted(topo.engines)
    first, second, third = names[:3]
    engines = dict(topo.engines)
    engines[first] = replace(engines[first], args={**engines[first].args, "max_model_len": 4096})
    engines[second] = replace(engines[second], args={**engines[second].args, "max_model_len": 4096})
    unset = {k: v for k, v in engines[third].args.items() if k != "max_model_len"}
    engines[third] = replace(engines[third], args=unset)
    topo = replace(topo, engines=engines)
    assert topo.shortest_max_model_len([second, first, "no-such-engine"]) == (4096, first)
    assert topo.shortest_max_model_len([third, "no-such-engine"]) is None
    assert topo.shortest_max_model_len(names) == (4096, first)


def test_redundant_experts_count_only_with_eplb():
    topo = load_topology(REPO / "topologies/h20-v4flash-4p4d.yml")
    engine = next(iter(topo.engines.values()))
    eplb = {"eplb_config": {"num_redundant_experts": 8}}
    assert replace(engine, args={**eplb, "enable_eplb": True}).redundant_experts == 8
    assert replace(engine, args={**eplb, "enable_eplb": False}).redundant_experts == 0
    assert replace(engine, args={"enable_eplb": True}).redundant_experts == 0
