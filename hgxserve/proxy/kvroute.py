"""KV-aware routing (docs/proxy.md "KV-aware routing"): each route's policy, the request's
prompt as the router sees it, and the decision with its reason.

Each route has its policy (hgxserve/proxy/policies/, one module each behind `Policy`): it
says what the router keeps for its engines (an index of the prompt text sent there, the engines'
KV events) and how many of a request's prompt tokens an engine holds cached. The router keeps
the indexes, the score, stickiness, P/D and overflow, the same for every policy; with a policy
whose decision is the balancer's own (`least-outstanding`) on every route, the balancer decides.

Score of a candidate = uncached prompt tokens + inflight_token_weight x its tokens in flight
(an estimate of the wait before this request's first token, in tokens of work). The candidate
holding the longest cached prefix keeps the request unless its score passes
sticky_max_wait_ratio x the best other's, so one hot prefix takes at most
ratio / (ratio + n - 1) of n engines' load. P/D: the decode is chosen first; with vllm-nixl a
prompt with fewer than pd_remote_prefill_min_uncached_tokens uncached tokens on that decode is
prefilled there (route `pd-local`); else the prefill is chosen by the same score. Overflow:
long prompts go to combined engines when every decode is over pair_max_inflight_tokens, short
ones to P/D when every combined engine is over combined_max_inflight_tokens.

    router = Router(config, pool)
    plan = router.plan(body, "chat")
    decision = router.decide(plan, exclude=set())
    router.begin(decision, plan); ...; router.end(decision, plan)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.promtext import Labels, family, histogram
from hgxserve.proxy.balancer import Decision, Instance, Pool
from hgxserve.proxy.body import estimate_prompt_tokens
from hgxserve.proxy.config import ProxyConfig
from hgxserve.proxy.kvevents import Subscriber
from hgxserve.proxy.kvindex import ApproxIndex, BlockIndex, text_chain
from hgxserve.proxy.policies import POLICIES
from hgxserve.proxy.policies.base import Plan, Policy
from hgxserve.proxy.tokens import PromptTokenizer, TokenizerError

log = logging.getLogger("hgxserve.proxy")

# A request without max_tokens holds its engine for an answer of this many tokens in the
# in-flight count (the seeds' chat answers are 200-1,000 tokens; vLLM would allow up to the
# context length, which would make every such request look like the longest possible one)
OUTPUT_TOKENS_BOUND = 1024
CACHED_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
# one tokenizer per process and directory: reloads keep it (a failed load is tried again by
# the next reload)
_TOKENIZERS: dict[str, PromptTokenizer] = {}


def load_tokenizer(directory: str) -> PromptTokenizer | None:
    """The directory's tokenizer, loaded once per process; None (logged) when unusable."""
    if directory not in _TOKENIZERS:
        try:
            _TOKENIZERS[directory] = PromptTokenizer.load(directory)
        except TokenizerError as exc:
            log.error("no tokenizer, prompts are matched approximately: %s", exc)
            return None
        log.info("tokenizer loaded from %s", directory)
    return _TOKENIZERS[directory]


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt's text for the approximate index: a completion's prompt, or each chat
    message's role and text content in order."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    parts: list[str] = []
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        parts.append(f"<{msg.get('role')}>{content if isinstance(content, str) else ''}")
    return "\n".join(parts)


def output_bound(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value >= 0:
            return min(value, OUTPUT_TOKENS_BOUND * 8)
    return OUTPUT_TOKENS_BOUND


@dataclass
class RouteStats:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    paths: dict[str, int] = field(default_factory=dict)
    cached: list[int] = field(default_factory=lambda: [0] * (len(CACHED_BUCKETS) + 1))
    cached_sum: int = 0
    ejected_clears: int = 0

    def observe(self, cached: int) -> None:
        self.cached_sum += cached
        for i, bound in enumerate(CACHED_BUCKETS):
            if cached <= bound:
                self.cached[i] += 1
                return
        self.cached[-1] += 1


@dataclass
class Pick:
    inst: Instance
    cached: int
    reason: str


class Router:
    """The routing decision for every request, by each route's policy."""

    def __init__(self, config: ProxyConfig, pool: Pool) -> None:
        self.config = config
        self.pool = pool
        self.routing = routing = config.routing
        self.stats = RouteStats()
        self.policy_of: dict[Instance, Policy] = {}
        self.group_of: dict[Instance, int] = {}
        policies = {name: policy(routing) for name, policy in POLICIES.items()}
        for inst in pool.combined:
            self.policy_of[inst] = policies[config.combined_policy or routing.policy]
        for gi, (group, (prefills, decodes)) in enumerate(
            zip(config.pd_groups, pool.groups, strict=True)
        ):
            for inst in prefills + decodes:
                self.policy_of[inst] = policies[group.policy or routing.policy]
                self.group_of[inst] = gi
        # the pool's instances are fixed for this router's life (a reload builds both anew)
        self.decodes = [d for _, ds in pool.groups for d in ds]
        used = set(self.policy_of.values())
        self.simple = all(p.balancer_decides for p in used)
        self.tokenizer = (
            load_tokenizer(routing.tokenizer_dir)
            if any(p.kv_events for p in used) and routing.tokenizer_dir
            else None
        )
        self.approx = {
            i: ApproxIndex(routing.approx_ttl_s) for i, p in self.policy_of.items() if p.text_index
        }
        self.indexes: dict[Instance, list[BlockIndex]] = {}
        self.subscribers: list[tuple[Instance, int, Subscriber]] = []
        if self.tokenizer is not None:
            self._subscribe()
        for inst in pool.instances:
            inst.on_eject = self.forget
        self.tasks: list[asyncio.Task[None]] = []

    def _subscribe(self) -> None:
        for inst, policy in self.policy_of.items():
            events = inst.endpoint.kv_events
            if not policy.kv_events or events is None:
                continue
            ranks = self.indexes[inst] = []
            for rank, publisher in enumerate(events.publishers):
                idx = BlockIndex()
                replay = events.replays[rank] if events.replays else None
                sub = Subscriber(publisher, replay, events.topic, idx)
                ranks.append(idx)
                self.subscribers.append((inst, rank, sub))

    def start(self) -> None:
        self.tasks = [asyncio.create_task(sub.run()) for _, _, sub in self.subscribers]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks = []

    def forget(self, inst: Instance) -> None:
        """An engine left rotation: what the indexes knew of its cache is no longer known."""
        cleared = False
        for idx in self.indexes.get(inst, ()):
            cleared |= len(idx) > 0
            idx.clear()
        approx = self.approx.get(inst)
        if approx is not None:
            cleared |= len(approx) > 0
            approx.clear()
        self.stats.ejected_clears += cleared

    # ------------------------------------------------------------------ the request

    def plan(self, body: dict[str, Any], endpoint: str) -> Plan:
        """What routing needs of a request body: tokens, and its prefix key (policy's own)."""
        if self.simple:
            return Plan(estimate_prompt_tokens(body, self.routing.bytes_per_token))
        if self.tokenizer is not None:
            try:
                ids = self.tokenizer.prompt_ids(body, endpoint)
                self._path("tokens")
                return Plan(len(ids), len(ids) + output_bound(body), ids=ids)
            except Exception:  # any failure at all: this request is matched approximately
                self._path("tokenizer-failed")
        self._path("approximate")
        estimate = estimate_prompt_tokens(body, self.routing.bytes_per_token)
        chunks = text_chain(prompt_text(body))
        return Plan(estimate, estimate + output_bound(body), chunks=chunks)

    def _path(self, path: str) -> None:
        self.stats.paths[path] = self.stats.paths.get(path, 0) + 1

    def cached(self, inst: Instance, plan: Plan) -> int:
        """Prompt tokens of this request `inst` holds by its route's policy."""
        policy = self.policy_of.get(inst)
        if policy is None:
            return 0
        return policy.cached(plan, self.indexes.get(inst, ()), self.approx.get(inst))

    def wait(self, inst: Instance, plan: Plan, cached: int) -> float:
        uncached = max(plan.tokens - cached, 0)
        return uncached + self.routing.inflight_token_weight * inst.inflight_tokens

    def pick(self, cands: list[Instance], plan: Plan, exclude: set[Instance]) -> Pick | None:
        """The candidate by cache and load: the best-cached one keeps the request unless its
        wait passes sticky_max_wait_ratio x the least wait (then the least wait takes it)."""
        live = [i for i in cands if i.healthy and i not in exclude]
        if len(live) <= 1:  # none, or one: no other to weigh it against
            if not live:
                return None
            cached = self.cached(live[0], plan)
            return Pick(live[0], cached, "cache-hit" if cached else "no-cache")
        scored = [(i, self.cached(i, plan)) for i in live]
        waits = {i: self.wait(i, plan, c) for i, c in scored}
        best, best_cached = min(scored, key=lambda s: (waits[s[0]], *s[0].sort_key()))
        top, top_cached = max(scored, key=lambda s: (s[1], -waits[s[0]]))
        if top_cached == 0:
            return Pick(best, best_cached, "no-cache")
        if top is best or waits[top] <= self.routing.sticky_max_wait_ratio * max(waits[best], 1.0):
            return Pick(top, top_cached, "cache-hit")
        return Pick(best, best_cached, "load")

    # ------------------------------------------------------------------ the decision

    def decide(self, plan: Plan, exclude: set[Instance] | None = None) -> Decision | None:
        """Where the request goes, by each route's policy; counted with its reason."""
        exclude = exclude or set()
        if self.simple:
            decision = self.pool.decide(plan.tokens, exclude)
        else:
            decision = self._decide(plan, exclude)
        if decision is not None:
            key = (decision.route, decision.reason or "length")
            self.stats.decisions[key] = self.stats.decisions.get(key, 0) + 1
        return decision

    def _decide(self, plan: Plan, exclude: set[Instance]) -> Decision | None:
        pool, routing = self.pool, self.routing
        long = bool(pool.groups) and (plan.tokens >= routing.pd_min_prompt_tokens
                                      or not pool.combined)  # fmt: skip
        pd_full = self._full(self.decodes, routing.pair_max_inflight_tokens, exclude)
        combined_full = self._full(pool.combined, routing.combined_max_inflight_tokens, exclude)
        decision: Decision | None
        if long:
            decision = None
            if pd_full and not combined_full:
                decision = self._combined(plan, exclude, "combined", "overflow")
            decision = decision or self._pd(plan, exclude)
            if decision is None and routing.fallback_to_combined:
                decision = self._combined(plan, exclude, "fallback", "no-pair")
        else:
            decision = None
            if combined_full and not pd_full:
                decision = self._pd(plan, exclude, "overflow")
            decision = decision or self._combined(plan, exclude, "combined", "")
            if decision is None:
                decision = self._pd(plan, exclude, "no-combined", route="fallback")
        if decision is None and self.config.protocol == "vllm-nixl":
            # a NIXL decode engine can prefill locally: slower, but it answers
            got = self.pick(self.decodes, plan, exclude)
            if got:
                decision = Decision("fallback", target=got.inst, reason="no-prefill")
        return decision

    def _full(self, insts: list[Instance], bound: int, exclude: set[Instance]) -> bool:
        if not bound:
            return False
        live = [i for i in insts if i.healthy and i not in exclude]
        return bool(live) and all(i.inflight_tokens >= bound for i in live)

    def _combined(
        self, plan: Plan, exclude: set[Instance], route: str, reason: str
    ) -> Decision | None:
        if not self.pool.combined:
            return None
        got = self.pick(self.pool.combined, plan, exclude)
        if got is None:
            return None
        self.stats.observe(got.cached)
        return Decision(route, target=got.inst, reason=reason or got.reason)

    def _pd(
        self, plan: Plan, exclude: set[Instance], reason: str = "", route: str = "pd"
    ) -> Decision | None:
        """Decode first (by cache and load), then a local or remote prefill."""
        live_groups = {
            gi
            for gi, (prefills, _) in enumerate(self.pool.groups)
            if any(p.healthy and p not in exclude for p in prefills)
        }
        decodes = [d for d in self.decodes if self.group_of[d] in live_groups]
        got = self.pick(decodes, plan, exclude)
        if got is None:
            return None
        self.stats.observe(got.cached)
        why = reason or got.reason
        uncached = plan.tokens - got.cached
        local = self.routing.pd_remote_prefill_min_uncached_tokens
        if self.config.protocol == "vllm-nixl" and uncached < local:
            return Decision("pd-local", target=got.inst, reason=why)
        prefills = self.pool.groups[self.group_of[got.inst]][0]
        prefill = self.pick(prefills, plan, exclude)
        assert prefill is not None  # the decode's group has a live prefill
        return Decision(route, target=got.inst, prefill=prefill.inst, reason=why)

    # ------------------------------------------------------------------ in flight

    def begin(self, decision: Decision, plan: Plan) -> None:
        """The request is on its way: its tokens count against its engines."""
        decision.target.inflight_tokens += plan.cost
        if decision.prefill is not None:
            decision.prefill.inflight_tokens += plan.tokens
        if plan.chunks:
            for inst in (decision.target, decision.prefill):
                approx = self.approx.get(inst) if inst is not None else None
                if approx is not None:
                    approx.record(plan.chunks)

    def end(self, decision: Decision, plan: Plan) -> None:
        decision.target.inflight_tokens -= plan.cost
        if decision.prefill is not None:
            decision.prefill.inflight_tokens -= plan.tokens

    # ------------------------------------------------------------------ metrics

    def render(self, out: list[str]) -> None:
        """The router's families for /metrics (appended to `out`)."""
        s = self.stats
        decisions = sorted(s.decisions.items())
        family(out, "hgxserve_proxy_route_decisions_total", "counter",
               "Routing decisions by route and reason (docs/proxy.md \"KV-aware routing\").",
               [({"route": r, "reason": why}, n) for (r, why), n in decisions])  # fmt: skip
        family(out, "hgxserve_proxy_prompt_match_total", "counter",
               "Requests by how their prefix was matched: tokens, approximate, "
               "tokenizer-failed (then approximate).",
               [({"path": p}, n) for p, n in sorted(s.paths.items())])  # fmt: skip
        prefix = self.tokenizer.prefix if self.tokenizer is not None else None
        family(out, "hgxserve_proxy_prompt_prefix_reuse_total", "counter",
               "Chat prompts tokenized from a remembered prefix (hit) or whole (miss); "
               "mismatch: a checked reuse differed and reuse was turned off.",
               [({"result": k}, v) for k, v in (("hit", prefix.hits), ("miss", prefix.misses),
                ("mismatch", prefix.mismatches))] if prefix else [])  # fmt: skip
        histogram(out, "hgxserve_proxy_cached_prompt_tokens",
                  "Prompt tokens the chosen engine held cached (by the route's index).",
                  CACHED_BUCKETS, s.cached, s.cached_sum)  # fmt: skip
        where = [(self._labels(i), i) for i in self.pool.instances]
        family(out, "hgxserve_proxy_inflight_tokens", "gauge",
               "Tokens in flight per instance (prompt + answer bound).",
               [(w, i.inflight_tokens) for w, i in where])  # fmt: skip
        family(out, "hgxserve_proxy_approx_index_chunks", "gauge",
               "Prompt-text chunks the approximate index remembers per instance.",
               [(w, len(self.approx[i])) for w, i in where if i in self.approx])  # fmt: skip
        family(out, "hgxserve_proxy_kv_index_ejection_clears_total", "counter",
               "Instances whose cached-prefix entries were dropped as they left rotation.",
               [({}, s.ejected_clears)])  # fmt: skip
        self._render_events(out)

    @staticmethod
    def _labels(inst: Instance) -> Labels:
        return {"role": inst.role, "instance": inst.url}

    def _render_events(self, out: list[str]) -> None:
        blocks: list[tuple[Labels, object]] = []
        dropped: list[tuple[Labels, object]] = []
        events: list[tuple[Labels, object]] = []
        counters: list[tuple[Labels, object]] = []
        for inst, rank, sub in self.subscribers:
            w = self._labels(inst) | {"rank": str(rank)}
            idx = self.indexes[inst][rank]
            blocks.append((w, len(idx)))
            for why, n in (("full", idx.dropped), ("orphan", idx.orphans),
                           ("not-matched", idx.skipped)):  # fmt: skip
                dropped.append((w | {"why": why}, n))
            for kind, n in sorted(sub.stats.events.items()):
                events.append((w | {"type": kind}, n))
            st = sub.stats
            for what, n in (("replayed", st.replayed), ("garbage", st.garbage),
                            ("gaps", st.gaps), ("restarts", st.restarts),
                            ("replay_failures", st.replay_failures),
                            ("connects", st.connects)):  # fmt: skip
                counters.append((w | {"what": what}, n))
        family(out, "hgxserve_proxy_kv_index_blocks", "gauge",
               "Blocks in the KV-event index per engine publisher (DP rank).", blocks)  # fmt: skip
        family(out, "hgxserve_proxy_kv_index_dropped_blocks_total", "counter",
               "Stored blocks not indexed: full (the cap), orphan (unknown parent), "
               "not-matched (LoRA, multimodal, other medium).", dropped)  # fmt: skip
        family(out, "hgxserve_proxy_kv_events_total", "counter",
               "KV events applied per engine publisher, by type.", events)  # fmt: skip
        family(out, "hgxserve_proxy_kv_event_stream_total", "counter",
               "KV event stream: batches replayed, garbage messages, seq gaps, engine "
               "restarts, failed replays, connects.", counters)  # fmt: skip
