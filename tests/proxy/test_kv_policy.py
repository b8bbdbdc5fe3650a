"""Routing policies: least-outstanding unchanged, KV-event stickiness gated by load (no hot
spot), P/D decode first with local or remote prefill, overflow both ways, decisions counted."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from kvwire import store_prompt, write_tokenizer

from hgxserve.proxy.balancer import Decision, Instance, Pool
from hgxserve.proxy.config import parse_proxy_config
from hgxserve.proxy.kvevents import decode_batch
from hgxserve.proxy.kvroute import Plan, Router


def events(port: int) -> dict[str, Any]:
    return {"publishers": [f"tcp://127.0.0.1:{port}"]}


def url(port: int, kv: bool = True) -> dict[str, Any]:
    entry: dict[str, Any] = {"url": f"http://127.0.0.1:{port}"}
    if kv:
        entry["kv_events"] = events(port + 1000)
    return entry


def make(tmp_path: Path, **raw: Any) -> tuple[Router, Pool]:
    write_tokenizer(tmp_path)
    routing = {"policy": "kv-events", "tokenizer_dir": str(tmp_path), **raw.pop("routing", {})}
    config = parse_proxy_config({"protocol": "vllm-nixl", "served_model_name": "m",
                                 "routing": routing, **raw})  # fmt: skip
    pool = Pool(config)
    for inst in pool.instances:
        inst.set_healthy(True)
    return Router(config, pool), pool


def cache(router: Router, inst: Instance, ids: list[int]) -> None:
    router.indexes[inst][0].apply(decode_batch(store_prompt(ids)))


def prompt(router: Router, ids: list[int], max_tokens: int = 100) -> Plan:
    return router.plan({"prompt": ids, "max_tokens": max_tokens}, "completions")


PREFIX = list(range(2000))  # 125 blocks
PROMPT = PREFIX + list(range(5000, 5200))


def test_least_outstanding_decisions_are_unchanged() -> None:
    config = parse_proxy_config({
        "protocol": "vllm-nixl", "served_model_name": "m",
        "pd_groups": [{"name": "a", "prefill": [url(1, False), url(2, False)],
                       "decode": [url(3, False)]},
                      {"name": "b", "prefill": [url(4, False)], "decode": [url(5, False)]}],
        "combined": [url(6, False), url(7, False)],
        "routing": {"pd_min_prompt_tokens": 100},
    })  # fmt: skip
    pool = Pool(config)
    router = Router(config, pool)
    assert router.simple
    rng = random.Random(7)
    for _ in range(2000):
        for inst in pool.instances:
            inst.outstanding = rng.randrange(4)
            inst.picked = rng.randrange(4)
            inst.healthy = rng.random() > 0.2
        exclude = set(rng.sample(pool.instances, rng.randrange(3)))
        tokens = rng.choice([0, 99, 100, 5000])
        want = pool.decide(tokens, exclude)
        got = router.decide(Plan(tokens), exclude)
        assert (got and (got.route, got.target, got.prefill)) == (
            want and (want.route, want.target, want.prefill)
        )
    assert {why for _, why in router.stats.decisions} == {"length"}


def test_sticky_on_the_cached_engine_until_its_wait_is_too_long(tmp_path: Path) -> None:
    router, pool = make(tmp_path, combined=[url(p) for p in (1, 2, 3, 4)])
    hot = pool.combined[2]
    cache(router, hot, PREFIX)
    plan = prompt(router, PROMPT)
    d = router.decide(plan)
    assert d is not None and (d.target, d.route, d.reason) == (hot, "combined", "cache-hit")
    # busier than an idle engine, but within the ratio: it stays (200 uncached + 3,000
    # in flight against 2,200 uncached elsewhere: 3,200 <= 2 x 2,200)
    hot.inflight_tokens = 3000
    assert router.decide(plan).target is hot  # type: ignore[union-attr]
    hot.inflight_tokens = 5000  # 5,200 > 2 x 2,200: the least wait takes it
    d = router.decide(plan)
    assert d is not None and d.target is not hot and d.reason == "load"
    # no engine holds anything of it: least wait, and among equals least outstanding
    other = router.decide(prompt(router, list(range(9000, 9300))))
    assert other is not None and other.reason == "no-cache" and other.target is not hot
    assert router.stats.decisions[("combined", "cache-hit")] == 2


@pytest.mark.parametrize("engines_cache_too", [False, True])
def test_one_hot_prefix_does_not_pin_one_engine(tmp_path: Path, engines_cache_too: bool) -> None:
    """1 hot prefix, 4 engines, 400 requests in flight at once: the engine first holding the
    prefix takes at most ratio / (ratio + n - 1) = 40 % (+ one request), also when the others
    never cache it; when they do, the load spreads evenly."""
    router, pool = make(tmp_path, combined=[url(p) for p in (1, 2, 3, 4)])
    cache(router, pool.combined[0], PREFIX)
    taken = {i: 0 for i in pool.combined}
    for n in range(400):
        plan = prompt(router, PREFIX + [7000 + n] * 64)
        d = router.decide(plan)
        assert d is not None
        router.begin(d, plan)  # in flight, never finishing: the load only grows
        taken[d.target] += 1
        if engines_cache_too:
            cache(router, d.target, PREFIX)
    shares = sorted(n / 400 for n in taken.values())
    assert shares[-1] <= 2 / (2 + 3) + 0.01, shares
    if engines_cache_too:
        assert shares[-1] - shares[0] <= 0.02, shares
    else:
        assert min(shares) >= 0.18, shares


def pd_config(**kw: Any) -> dict[str, Any]:
    return {
        "pd_groups": [{"name": "g", "prefill": [url(1), url(2)], "decode": [url(3), url(4)]}],
        "routing": {"pd_min_prompt_tokens": 0},
        **kw,
    }


def test_pd_decode_first_then_local_or_remote_prefill(tmp_path: Path) -> None:
    router, pool = make(tmp_path, **pd_config())
    (p1, p2), (d1, d2) = pool.groups[0]
    cache(router, d2, PREFIX)  # the decode holds all but 200 tokens: it prefills itself
    d = router.decide(prompt(router, PROMPT))
    assert d == Decision("pd-local", target=d2, reason="cache-hit")
    # 1,200 uncached on the best decode: remote prefill, on the prefill holding the prefix
    cache(router, p2, PREFIX)
    d = router.decide(prompt(router, PREFIX[:1000] + list(range(8000, 9200))))
    assert d is not None and d.route == "pd" and d.target is d2 and d.prefill is p2
    # a decode busy past the ratio loses the request, and the prefill is chosen by score
    d2.inflight_tokens = 50_000
    d = router.decide(prompt(router, PROMPT))
    assert d is not None and d.route == "pd" and d.target is d1 and d.reason == "load"
    assert d.prefill is p2  # 200 uncached there against 2,200
    # SGLang decodes never prefill locally
    router.config = router.config.__class__(**{**router.config.__dict__, "protocol": "sglang"})
    d2.inflight_tokens = 0
    d = router.decide(prompt(router, PROMPT))
    assert d is not None and d.route == "pd" and d.target is d2 and d.prefill is not None


def test_overflow_both_ways(tmp_path: Path) -> None:
    raw = pd_config(combined=[url(5), url(6)])
    raw["routing"] = {"pd_min_prompt_tokens": 1000, "pair_max_inflight_tokens": 4000,
                      "combined_max_inflight_tokens": 3000}  # fmt: skip
    router, pool = make(tmp_path, **raw)
    decodes = pool.groups[0][1]
    long_plan = prompt(router, list(range(3000)))
    short_plan = prompt(router, list(range(500)))
    assert router.decide(long_plan).route == "pd"  # type: ignore[union-attr]
    assert router.decide(short_plan).route == "combined"  # type: ignore[union-attr]
    for d in decodes:
        d.inflight_tokens = 4000  # every pair at its bound: long prompts overflow
    got = router.decide(long_plan)
    assert got is not None and (got.route, got.reason) == ("combined", "overflow")
    for d in decodes:
        d.inflight_tokens = 0
    for c in pool.combined:
        c.inflight_tokens = 3500  # every combined engine over: short prompts to P/D
    got = router.decide(short_plan)
    assert got is not None and got.reason == "overflow" and got.target in decodes
    for d in decodes:
        d.inflight_tokens = 9000  # both sides full: each keeps its own
    assert router.decide(short_plan).route == "combined"  # type: ignore[union-attr]
    assert router.decide(long_plan).route == "pd"  # type: ignore[union-attr]
    out: list[str] = []
    router.render(out)
    text = "\n".join(out)
    assert 'hgxserve_proxy_route_decisions_total{route="combined",reason="overflow"} 1' in text
    assert 'hgxserve_proxy_kv_index_blocks{role="decode"' in text


def test_begin_and_end_balance_in_flight_tokens(tmp_path: Path) -> None:
    router, pool = make(tmp_path, **pd_config())
    plan = prompt(router, list(range(3000)), max_tokens=50)
    d = router.decide(plan)
    assert d is not None and d.prefill is not None
    router.begin(d, plan)
    assert (d.target.inflight_tokens, d.prefill.inflight_tokens) == (3050, 3000)
    router.end(d, plan)
    assert all(i.inflight_tokens == 0 for i in pool.instances)


def test_approximate_follows_its_own_decisions_until_the_ttl(tmp_path: Path) -> None:
    config = parse_proxy_config({
        "protocol": "vllm-nixl", "served_model_name": "m",
        "combined": [url(p, False) for p in (1, 2, 3)],
        "routing": {"policy": "approximate", "approx_ttl_s": 60},
    })  # fmt: skip
    pool = Pool(config)
    for inst in pool.instances:
        inst.set_healthy(True)
    router = Router(config, pool)
    system = "You answer questions about the deployment guide. " * 40
    first = {"messages": [{"role": "system", "content": system},
                          {"role": "user", "content": "one"}]}  # fmt: skip
    plan = router.plan(first, "chat")
    d = router.decide(plan)
    assert d is not None and d.reason == "no-cache"
    router.begin(d, plan)
    router.end(d, plan)
    second = {"messages": [{"role": "system", "content": system},
                           {"role": "user", "content": "two"}]}  # fmt: skip
    again = router.decide(router.plan(second, "chat"))
    assert again is not None and again.target is d.target and again.reason == "cache-hit"
    assert router.cached(d.target, router.plan(second, "chat")) >= len(system) // 4 - 16
    # past the TTL the prefix is forgotten
    router.approx[d.target].expire(now=10**12)
    later = router.decide(router.plan(second, "chat"))
    assert later is not None and later.reason == "no-cache"
    assert router.stats.paths == {"approximate": 4}


def test_fallbacks_when_a_side_is_down(tmp_path: Path) -> None:
    raw = pd_config(combined=[url(5)])
    raw["routing"] = {"pd_min_prompt_tokens": 1000}
    router, pool = make(tmp_path, **raw)
    (p1, p2), (d1, d2) = pool.groups[0]
    long_plan = prompt(router, list(range(3000)))
    short_plan = prompt(router, list(range(500)))
    for p in (p1, p2):
        p.set_healthy(False, "down")
    got = router.decide(long_plan)  # no pair: the combined engine
    assert got is not None and (got.route, got.reason) == ("fallback", "no-pair")
    pool.combined[0].set_healthy(False, "down")
    got = router.decide(long_plan)  # nothing but decodes: one prefills alone (vLLM NIXL)
    assert got is not None and (got.route, got.reason) == ("fallback", "no-prefill")
    assert got.prefill is None and got.target in (d1, d2)
    p1.set_healthy(True)
    got = router.decide(short_plan)  # no combined engine for a short prompt: P/D, where
    # 500 uncached tokens (< 512) are prefilled by the decode itself
    assert got is not None and (got.route, got.reason) == ("pd-local", "no-combined")
    got = router.decide(long_plan)
    assert got is not None and (got.route, got.prefill) == ("pd", p1)
    assert router.decide(short_plan, exclude={d1, d2}) is None


def test_one_live_candidate_is_picked_without_weighing(tmp_path: Path) -> None:
    # the short way for one live candidate (the others down or excluded) gives what scoring
    # them would: the candidate, its cached prefix, cache-hit or no-cache; none: no pick
    router, pool = make(tmp_path, combined=[url(p) for p in (1, 2, 3)])
    a, b, c = pool.combined
    cache(router, b, PREFIX)
    plan = prompt(router, PROMPT)
    b.inflight_tokens = 10**9  # load does not matter when there is no other
    got = router.pick(pool.combined, plan, exclude={a, c})
    assert got is not None and (got.inst, got.cached, got.reason) == (b, 2000, "cache-hit")
    c.healthy = False
    got = router.pick(pool.combined, plan, exclude={b})
    assert got is not None and (got.inst, got.cached, got.reason) == (a, 0, "no-cache")
    assert router.pick(pool.combined, plan, exclude={a, b}) is None
    assert router.pick([], plan, exclude=set()) is None
    # and with two, the full weighing: the busy cached one loses on load
    c.healthy = True
    got = router.pick(pool.combined, plan, exclude={a})
    assert got is not None and (got.inst, got.reason) == (c, "load")
