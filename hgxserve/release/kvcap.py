"""After the switch, the engines' own numbers: how long each took to serve, and the KV capacity
it reports, against what the topology's warm-up and bench shapes need and the fit estimate.

Seed 003 §6: the engine allocates its KV pool from what is left after weights, activations and
graphs (58.36 GiB per card, ~1.76 M tokens there); the estimate (hgxserve.topology.fit) is not
the engine. So after each engine is healthy the switch reads the capacity the engine reports
and keeps it, with its start time, in the release's record (`observed.json`, Store.observed):

- vLLM: `/metrics` `vllm:cache_config_info`, the info gauge of its CacheConfig (value 1, one
  sample per engine core, `engine` = the DP rank; vllm/v1/metrics/loggers.py
  log_metrics_info("cache_config", ...)): `num_gpu_blocks` x `block_size`, or
  `kv_cache_size_tokens` where the version exports it; else its log line
  `GPU KV cache size: 1,760,000 tokens` (vllm/v1/core/kv_cache_utils.py, `f"{num_tokens:,}"`,
  next to `Maximum concurrency for 204,800 tokens per request: 8.59x`);
- SGLang: `/get_server_info` `max_total_num_tokens` (the scheduler's init info, which the HTTP
  server merges into its server info: sglang/srt/managers/scheduler.py get_init_info,
  entrypoints/http_server.py), else its log line `KV Cache is allocated. #tokens: 524288, KV
  size: 17.16 GB` (sglang/srt/mem_cache/memory_pool.py).

Each reading is per DP rank (an engine core's pool); an engine's capacity is that times its DP
ranks. `kv_check` compares it with the largest shape's need (`KvNeed`, computed on the
controller by `topology_needs`) as `gate.kv_capacity` says (fail | warn | off).
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hgxserve.base.errors import HgxserveError
from hgxserve.base.promtext import parse_samples
from hgxserve.release.store import Store

if TYPE_CHECKING:  # the controller's side; the host's `release switch` does not load them
    from hgxserve.topology.model import Engine, Topology

CACHE_CONFIG_INFO = "vllm:cache_config_info"
_VLLM_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_VLLM_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_SGLANG_LOG = re.compile(r"KV Cache is allocated\. #tokens: (\d+)")


@dataclass(frozen=True)
class KvReading:
    """The KV capacity an engine reported: tokens per DP rank (the smallest rank's pool)."""

    tokens: int
    source: str  # where it was read: metrics, server_info or log
    block_size: int | None = None
    ranks: int = 1  # engine cores the reading saw (vLLM metrics: one sample per DP rank)
    max_concurrency: float | None = None  # vLLM's log: sequences of max_model_len tokens


def _int(value: object) -> int | None:
    try:
        return int(str(value).replace(",", ""))
    except ValueError:
        return None


def vllm_metrics_capacity(text: str) -> KvReading | None:
    """The capacity in vLLM's /metrics text (`vllm:cache_config_info`); None without it.

    >>> vllm_metrics_capacity('vllm:cache_config_info{block_size="64",engine="0",'
    ...     'num_gpu_blocks="27500"} 1.0')
    KvReading(tokens=1760000, source='metrics', block_size=64, ranks=1, max_concurrency=None)
    """
    pools = []
    block = None
    for name, labels, _ in parse_samples(text):
        if name != CACHE_CONFIG_INFO:
            continue
        block = _int(labels.get("block_size")) or block
        tokens = _int(labels.get("kv_cache_size_tokens"))
        blocks = _int(labels.get("num_gpu_blocks"))
        if tokens is None and blocks is not None and block:
            tokens = blocks * block
        if tokens is not None:
            pools.append(tokens)
    if not pools:
        return None
    return KvReading(min(pools), "metrics", block, len(pools))


def vllm_log_capacity(text: str) -> KvReading | None:
    """The capacity in vLLM's start log (the last `GPU KV cache size` line).

    >>> vllm_log_capacity("INFO GPU KV cache size: 1,760,000 tokens\\n"
    ...     "INFO Maximum concurrency for 204,800 tokens per request: 8.59x")
    KvReading(tokens=1760000, source='log', block_size=None, ranks=1, max_concurrency=8.59)
    """
    sizes = _VLLM_LOG.findall(text)
    if not sizes:
        return None
    concurrency = _VLLM_CONCURRENCY.findall(text)
    return KvReading(
        int(sizes[-1].replace(",", "")),
        "log",
        max_concurrency=float(concurrency[-1][1]) if concurrency else None,
    )


def sglang_log_capacity(text: str) -> KvReading | None:
    """The capacity in SGLang's start log (the smallest `KV Cache is allocated` of the ranks).

    >>> sglang_log_capacity("[TP0] KV Cache is allocated. #tokens: 524288, KV size: 17.16 GB")
    KvReading(tokens=524288, source='log', block_size=None, ranks=1, max_concurrency=None)
    """
    sizes = [int(n) for n in _SGLANG_LOG.findall(text)]
    return KvReading(min(sizes), "log") if sizes else None


def sglang_server_info_capacity(text: str) -> KvReading | None:
    """`max_total_num_tokens` of SGLang's /get_server_info (top level, or per DP rank in
    `internal_states`); None when the answer has none."""
    try:
        info = json.loads(text)
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    values = [_int(s.get("max_total_num_tokens")) for s in [info, *states]]
    found = [v for v in values if v]
    return KvReading(min(found), "server_info") if found else None


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode("utf-8", "replace")) if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def read_capacity(health_url: str, journal: str) -> KvReading | None:
    """What the engine behind `health_url` reports: its metrics or server info, else its log."""
    base = health_url.rsplit("/", 1)[0]
    metrics = _get(f"{base}/metrics")
    reading = vllm_metrics_capacity(metrics) if metrics else None
    if reading is None and metrics is not None and "sglang:" in metrics:
        info = _get(f"{base}/get_server_info")
        reading = sglang_server_info_capacity(info) if info else None
    log = vllm_log_capacity(journal) or sglang_log_capacity(journal)
    if reading is None:
        return log
    if log is not None and reading.max_concurrency is None:
        return KvReading(**{**asdict(reading), "max_concurrency": log.max_concurrency})
    return reading


def observation(start_s: float, reading: KvReading | None) -> dict[str, Any]:
    """A unit's entry in the release record: its start time and the KV capacity it reported."""
    entry: dict[str, Any] = {"start_s": round(start_s, 1), "kv_tokens": None}
    if reading is not None:
        entry.update(
            kv_tokens=reading.tokens,
            kv_source=reading.source,
            kv_block_size=reading.block_size,
            kv_ranks=reading.ranks,
            kv_max_concurrency=reading.max_concurrency,
        )
    return entry


def observed_line(unit: str, entry: dict[str, Any]) -> str:
    """`hgxserve-decode-0.service: served after 41.2s; KV capacity 1,760,000 tokens (metrics)`"""
    tokens = entry.get("kv_tokens")
    kv = (
        f"KV capacity {tokens:,} tokens per DP rank ({entry.get('kv_source')})"
        if tokens is not None
        else "KV capacity not reported (no vllm:cache_config_info, server info or log line)"
    )
    return f"{unit}: served after {entry.get('start_s')}s; {kv}"


# -- the check ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvNeed:
    """What one engine's KV must hold: its largest shape, and the fit estimate to compare."""

    engine: str
    need_tokens: int  # the whole engine (all its DP ranks)
    shape: str  # which shape, e.g. "warm-up 128x64x8: 8 x (128+64)"
    dp: int = 1
    fit_tokens: int | None = None  # the estimate per DP rank (hgxserve.topology.fit)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvNeed:
        return cls(**data)


def kv_check(unit: str, entry: dict[str, Any], need: KvNeed) -> tuple[str, dict[str, Any]]:
    """("ok" | "short" | "unread", the record's new fields with the message) for one unit."""
    tokens = entry.get("kv_tokens")
    fields: dict[str, Any] = {
        "engine": need.engine,
        "kv_need_tokens": need.need_tokens,
        "kv_need_shape": need.shape,
        "kv_fit_tokens": need.fit_tokens,
        "kv_fit_ratio": None,
    }
    if tokens is None:
        fields["kv_verdict"] = "unread"
        fields["kv_message"] = (
            f"{need.engine} ({unit}) reported no KV capacity: not checked against the "
            f"{need.need_tokens:,} tokens its largest shape needs ({need.shape})"
        )
        return "unread", fields
    total = int(tokens) * need.dp
    ratio = round(int(tokens) / need.fit_tokens, 3) if need.fit_tokens else None
    fields["kv_fit_ratio"] = ratio
    ranks = f"{need.dp} DP ranks x {int(tokens):,}" if need.dp > 1 else "1 DP rank"
    fit = (
        f"; the fit estimate was {need.fit_tokens:,} per DP rank (engine/estimate {ratio:.2f})"
        if need.fit_tokens and ratio is not None
        else "; no fit estimate (model.config unset)"
    )
    short = total < need.need_tokens
    fields["kv_verdict"] = "short" if short else "ok"
    relation = "below" if short else "enough for"
    fields["kv_message"] = (
        f"{need.engine} ({unit}) holds {total:,} KV tokens ({ranks}, from its "
        f"{entry.get('kv_source')}), {relation} the {need.need_tokens:,} its largest shape "
        f"needs ({need.shape}){fit}"
    )
    return fields["kv_verdict"], fields


# -- the need, on the controller ------------------------------------------------------------

BenchShape = tuple[str, int, int, int]  # scenario name, input, output, concurrency


def _warmup_need(topo: Topology, engine: Engine) -> list[tuple[int, str]]:
    """Every warm-up shape goes to the engine itself, all requests at once (the unit's
    ExecStartPost=; hgxserve.render.engine_warmup): none for SGLang's disaggregated engines."""
    if engine.engine == "sglang" and engine.role in ("prefill", "decode"):
        return []
    return [
        (
            w.concurrency * (w.input + w.output),
            f"warm-up {w.input}x{w.output}x{w.concurrency}: "
            f"{w.concurrency} x ({w.input}+{w.output})",
        )
        for w in topo.warmup
    ]


def _bench_need(topo: Topology, engine: Engine, bench: list[BenchShape]) -> list[tuple[int, str]]:
    """A bench shape goes through the proxy: its concurrency splits over the engines of this
    role it reaches; a P/D prefill holds the prompt (+1 token), the others prompt and output."""
    from hgxserve.topology.model import Warmup
    from hgxserve.topology.ports import warmup_targets

    out = []
    for name, inp, output, concurrency in bench:
        targets = warmup_targets(topo, Warmup(inp, output, concurrency, "completions"))
        peers = [n for n in targets if n in topo.engines and topo.engines[n].role == engine.role]
        if engine.name not in peers:
            continue
        share = math.ceil(concurrency / len(peers))
        length = inp + 1 if engine.role == "prefill" else inp + output
        out.append(
            (share * length, f"bench {name} c{concurrency}: {share} x ({inp}+{length - inp})")
        )
    return out


def topology_needs(topo: Topology, bench: list[BenchShape]) -> dict[str, KvNeed]:
    """Engine name -> its largest shape's KV need (0 without a warm-up or bench shape that
    reaches it) and the fit estimate."""
    from hgxserve.topology.fit import topology_fit

    try:
        _, fits = topology_fit(topo)
    except (HgxserveError, ValueError):  # a broken model config: no estimate to compare
        fits = {}
    needs = {}
    for engine in topo.engines.values():
        shapes = _warmup_need(topo, engine) + _bench_need(topo, engine, bench)
        tokens, shape = max(shapes) if shapes else (0, "no warm-up or bench shape")
        fit = fits.get(engine.name)
        needs[engine.name] = KvNeed(
            engine.name, tokens, shape, max(1, engine.dp), fit.kv_tokens if fit else None
        )
    return needs


# -- on the host: check the record against the needs ----------------------------------------


def check_release(
    store: Store, release_id: str, needs: dict[str, KvNeed], log: Callable[[str], None]
) -> list[str]:
    """Check each unit's recorded KV capacity against its need, keep the need, the estimate,
    their ratio and the verdict in the release's record, and say each; returns the messages
    of the units whose capacity is short."""
    observed = store.observed(release_id)
    short = []
    for unit, need in sorted(needs.items()):
        verdict, fields = kv_check(unit, observed.get(unit, {}), need)
        store.note_observed(release_id, unit, fields)
        log(f"KV {verdict.upper() if verdict == 'short' else verdict}: {fields['kv_message']}")
        if verdict == "short":
            short.append(fields["kv_message"])
    return short


def kv_needs_by_host(
    topo: Topology, bench: list[BenchShape]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Host -> engine unit -> its KvNeed fields, for the hosts that serve each engine's API
    (its head: the unit that reports the capacity), from the warm-up and `bench` shapes (the
    topology's scenarios at their highest concurrency: hgxserve.bench.scenario.kv_shapes)."""
    from hgxserve.render.types import unit_name

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, need in topology_needs(topo, bench).items():
        if not need.need_tokens:
            continue  # no shape reaches it: nothing to hold
        engine = topo.engines[name]
        out.setdefault(engine.head, {})[unit_name(name)] = asdict(need)
    return out


# -- for `plan`: the last release's numbers against this topology ----------------------------


def observed_from(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Unit -> its record, from a `hgxserve status --json` report (each unit's `observed`), a
    bench `run.json` (`engines_observed`) or one host's `hgxserve release status` (`observed`)."""
    out: dict[str, dict[str, Any]] = {}
    for view in (doc.get("hosts") or {}).values():
        for unit in ((view or {}).get("snapshot") or {}).get("units") or []:
            if unit.get("observed"):
                out[unit["name"]] = unit["observed"]
    for records in (doc.get("engines_observed") or {}).values():
        out.update(records)
    out.update(doc.get("observed") or {})
    return out


def last_release(
    topo: Topology, doc: dict[str, Any], bench: list[BenchShape]
) -> dict[str, dict[str, Any]]:
    """Engine -> what it reported in the release `doc` records (start time, KV capacity),
    checked against this topology's needs and fit estimate (the next run's)."""
    from hgxserve.render.types import unit_name

    records = observed_from(doc)
    out = {}
    for name, need in topology_needs(topo, bench).items():
        entry = records.get(unit_name(name))
        if entry is None:
            continue
        _, fields = kv_check(unit_name(name), entry, need)
        out[name] = {**{k: entry.get(k) for k in ("start_s", "kv_tokens", "kv_source")}, **fields}
    return out


def last_release_lines(source: str, engines: dict[str, dict[str, Any]]) -> list[str]:
    """`plan`'s text for `last_release`: one line per engine."""
    lines = ["", f"last release ({source}): start time and KV capacity against this topology"]
    if not engines:
        lines.append("  no engine of this topology in it")
    for name, entry in engines.items():
        lines.append(f"  {name}: started in {entry.get('start_s')}s; {entry['kv_message']}")
    return lines
