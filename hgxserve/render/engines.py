"""Engine command lines: the typed topology args mapped to vLLM and SGLang flags.

One function per engine builds the argv of one node of one engine (a single-node engine has one
node). Flags follow the seeds' working commands (seed 003 §5, §9.2, §12.1; seed 002; seed 000).

>>> plan = node_plan(topo, topo.engines["decode-0"], "h20-a")  # doctest: +SKIP
>>> vllm_argv(topo, topo.engines["decode-0"], plan)[:3]  # doctest: +SKIP
['/opt/vllm-0.26/bin/vllm', 'serve', '/models/DeepSeek-V4-Flash-0731']
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.defaults import KV_EVENTS_TOPIC
from hgxserve.render.types import RenderError
from hgxserve.topology.engine_args import (
    ARG_FLAGS,
    EngineArgs,
    EngineKind,
    flag,
    negated_flag,
    not_rendered,
)
from hgxserve.topology.model import Engine, Topology, is_loopback
from hgxserve.topology.placement import serving_tree
from hgxserve.topology.ports import (
    bind_widened_for,
    engine_bind,
    kv_crosses_hosts,
    kv_events_base_ports,
    kv_events_bind,
    publishes_kv_events,
    side_channel_host,
    uses_nixl_side_channel,
)


@dataclass(frozen=True)
class NodePlan:
    """What one host runs of one engine."""

    host: str
    node_rank: int
    nnodes: int
    gpus: tuple[int, ...]
    head_address: str
    bind: str
    side_channel_host: str | None
    dp_start: int
    dp_local: int
    # lines written as comments at the top of the unit (why a value was chosen)
    notes: list[str] = field(default_factory=list)

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0


VLLM_CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SGLANG_KV_CACHE_DTYPES = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "auto"}


def compact_json(value: Any) -> str:
    """JSON without spaces, keys in the order written (as in seed 003's commands)."""
    return json.dumps(value, separators=(",", ":"))


def node_plan(topo: Topology, engine: Engine, host: str) -> NodePlan:
    """Plan one engine's node on `host` (rank, GPUs, addresses, DP ranks)."""
    hosts = engine.hosts
    rank = hosts.index(host)
    head = topo.hosts[engine.head]
    ranks = engine.dp_ranks_on(host)
    side: str | None = None
    notes: list[str] = []
    if uses_nixl_side_channel(engine):
        # hgxserve.topology.ports is the one place that decides the side-channel address
        side = side_channel_host(topo, engine, host)
        crosses = kv_crosses_hosts(topo, engine)
        if is_loopback(side) and crosses:
            notes.append(f"warning: side channel {side} is loopback but P/D crosses hosts")
        elif crosses:
            notes.append(
                f"NIXL side channel on {side}: P/D crosses hosts, loopback would not be "
                "reachable (seed 003 §11.3)"
            )
    bind = engine_bind(topo, engine)
    widened = bind_widened_for(topo, engine)
    if widened and engine.kv is not None:
        notes.append(
            f"--host {bind}, not loopback beside the proxy: SGLang binds its disaggregation "
            f"bootstrap server (port {engine.kv.bootstrap_port}) to --host as well, and "
            f"{', '.join(widened)} on another host pulls KV through it"
        )
    return NodePlan(
        host=host,
        node_rank=rank,
        nnodes=len(hosts),
        gpus=engine.place[host],
        head_address=head.address,
        bind=bind,
        side_channel_host=side,
        dp_start=ranks.start if ranks else 0,
        dp_local=len(ranks),
        notes=notes,
    )


def max_num_seqs(topo: Topology, engine: Engine, plan: NodePlan) -> int:
    """Explicit max_num_seqs: the arg, else the largest warmup concurrency (bounds CUDA graphs)."""
    if "max_num_seqs" in engine.args:
        return int(engine.args["max_num_seqs"])
    if topo.warmup:
        value = max(w.concurrency for w in topo.warmup)
        plan.notes.append(
            f"max-num-seqs {value}: not set in args; the largest warmup concurrency, so CUDA "
            "graphs are captured only for batch sizes that will be used (seed 003 §5)"
        )
        return value
    plan.notes.append(
        "max-num-seqs 256: not set in args and no warmup shapes; the engines' usual default"
    )
    return 256


def _max_num_seqs(topo: Topology, engine: Engine, plan: NodePlan, typed: _TypedArgs) -> list[str]:
    typed.mark("max_num_seqs")
    return [flag("max_num_seqs", typed.engine), str(max_num_seqs(topo, engine, plan))]


def _skipped(engine: Engine, not_for: frozenset[str], plan: NodePlan) -> None:
    unused = sorted(k for k in engine.args if k in not_for)
    if unused:
        plan.notes.append(f"not applicable to {engine.engine}, not rendered: {', '.join(unused)}")


class _TypedArgs:
    """The typed args of one engine as one engine's renderer writes them: `write` renders args
    in the form the table gives (hgxserve.topology.engine_args), `mark` notes one the renderer
    wrote in its own way, and `rest` writes every set arg placed nowhere else, in table order:
    a new arg needs no renderer line."""

    def __init__(self, args: EngineArgs, engine: EngineKind) -> None:
        self.args: Mapping[str, object] = args
        self.engine = engine
        self.placed: set[str] = set()

    def mark(self, *keys: str) -> None:
        self.placed.update(keys)

    def write(self, *keys: str) -> list[str]:
        """Each of `keys` that is set, in the order given, in its table form."""
        self.mark(*keys)
        out: list[str] = []
        for key in keys:
            if key not in self.args:
                continue
            value, name = self.args[key], flag(key, self.engine)
            form = ARG_FLAGS[key].form
            if form == "value":
                out += [name, str(value)]
            elif form == "json":
                out += [name, compact_json(value)]
            elif value:  # switch and tristate: true -> --flag
                out.append(name)
            elif form == "tristate":  # false -> --no-flag
                out.append(negated_flag(name))
        return out

    def rest(self) -> list[str]:
        return self.write(
            *(
                k
                for k, f in ARG_FLAGS.items()
                if k not in self.placed and f.flag(self.engine) is not None
            )
        )


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


# batching and tokenizer args both engines take, written right after max_num_seqs
_BATCHING = ("max_num_batched_tokens", "max_cudagraph_capture_size", "tokenizer_mode")


def vllm_args(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    """`vllm serve` arguments (without the program) for one node."""
    typed = _TypedArgs(engine.args, "vllm")
    argv: list[str] = [serving_tree(topo.model)[0], "--served-model-name", topo.model.served_name]
    if plan.is_head:
        argv += ["--host", plan.bind, "--port", str(engine.port)]
    argv += ["--tensor-parallel-size", str(engine.tp)]
    if engine.pp > 1:
        argv += ["--pipeline-parallel-size", str(engine.pp)]
    argv += _vllm_parallel(topo, engine, plan)
    if engine.ep:
        argv.append("--enable-expert-parallel")
    argv += typed.write(
        "dtype",
        "trust_remote_code",
        "kv_cache_dtype",
        "block_size",
        "gpu_memory_utilization",
        "max_model_len",
    )
    argv += _max_num_seqs(topo, engine, plan, typed)
    argv += typed.write(
        *_BATCHING,
        "tool_call_parser",
        "enable_auto_tool_choice",
        "reasoning_parser",
        "chat_template",
        "enable_prefix_caching",
        "enforce_eager",
        "speculative_config",
        "attention_backend",
    )
    typed.mark("distributed_executor_backend")
    backend = engine.args.get("distributed_executor_backend")
    if backend is None and not engine.is_multi_node:
        backend = "mp"
        plan.notes.append(
            "distributed-executor-backend mp: single-node engine (ray gave garbled output, "
            "seed 003 §11.3)"
        )
    if backend is not None:
        argv += [flag("distributed_executor_backend", "vllm"), backend]
    argv += typed.write(
        "async_scheduling",
        "disable_nccl_for_dp_synchronization",
        "enable_eplb",
        "eplb_config",
        "all2all_backend",
    )
    argv += typed.rest()
    if engine.kv is not None:
        argv += ["--kv-transfer-config", compact_json(vllm_kv_transfer_config(engine))]
    argv += kv_events_args(topo, engine, plan)
    _skipped(engine, not_rendered("vllm"), plan)
    argv += list(engine.extra_args)
    return argv


def vllm_kv_transfer_config(engine: Engine) -> dict[str, Any]:
    """The --kv-transfer-config object (vLLM KVTransferConfig field names).

    `kv_load_failure_policy` is a top-level KVTransferConfig field in vLLM (default "fail"), so
    it is written only when it differs from that default, keeping seed 003 §9.2's exact text.
    """
    kv = engine.kv
    assert kv is not None
    if engine.role not in KV_ROLES:
        raise RenderError(f"engine {engine.name}: role {engine.role} takes no kv transfer")
    config: dict[str, Any] = {
        "kv_connector": VLLM_CONNECTORS[kv.connector],
        "kv_role": KV_ROLES[engine.role],
        "kv_buffer_device": kv.buffer_device,
    }
    if kv.failure_policy != "fail":
        config["kv_load_failure_policy"] = kv.failure_policy
    return config


def kv_events_config(topo: Topology, engine: Engine, host: str) -> dict[str, Any] | None:
    """The --kv-events-config object of `engine` on `host` (vLLM's KVEventsConfig keys; SGLang's
    KVEventsConfig takes the same ones and ignores enable_kv_cache_events), None when the engine
    publishes none. Ports are the DP rank 0 bases: each engine adds its rank itself. The
    publisher's endpoint is a wildcard, the only form either engine binds (any other address
    makes its PUB socket connect out); the replay listener binds where the HTTP API does."""
    if not publishes_kv_events(topo, engine):
        return None
    port, replay = kv_events_base_ports(engine)
    bind = kv_events_bind(topo, engine, host)
    if ":" in bind:
        bind = f"[{bind}]"
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://{bind}:{replay}",
        "topic": KV_EVENTS_TOPIC,
    }


def kv_events_args(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    """`--kv-events-config <json>` when the engine publishes KV events, with a unit note."""
    config = kv_events_config(topo, engine, plan.host)
    if config is None:
        return []
    plan.notes.append(
        f"KV events on {config['endpoint']} (replay {config['replay_endpoint']}), + the DP rank "
        "for each rank: the hgxserve proxy routes this engine with policy kv-events"
    )
    return ["--kv-events-config", compact_json(config)]


def _vllm_parallel(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    per_host_ranks = plan.dp_local
    if not engine.is_multi_node:
        return ["--data-parallel-size", str(engine.dp)] if engine.dp > 1 else []
    if per_host_ranks == 0:
        raise RenderError(
            f"engine {engine.name}: a tp x pp replica spanning hosts is not supported; place "
            "whole replicas on each host and spread DP ranks over hosts"
        )
    out = [
        "--data-parallel-size",
        str(engine.dp),
        "--data-parallel-size-local",
        str(per_host_ranks),
    ]
    if not plan.is_head:
        out = ["--headless", *out, "--data-parallel-start-rank", str(plan.dp_start)]
    return [
        *out,
        "--data-parallel-address",
        plan.head_address,
        "--data-parallel-rpc-port",
        str(engine.rpc_port),
    ]


# --------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------


def sglang_args(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    """`sglang serve` arguments (without the program) for one node."""
    args = engine.args
    typed = _TypedArgs(args, "sglang")
    argv: list[str] = []
    argv += typed.write("trust_remote_code")
    argv += [
        "--model-path",
        serving_tree(topo.model)[0],
        "--served-model-name",
        topo.model.served_name,
    ]
    argv += _sglang_parallel(engine, plan, typed)
    argv += typed.write("moe_runner_backend")
    typed.mark("all2all_backend", "speculative_config", "kv_cache_dtype")
    if "all2all_backend" in args:
        argv += _sglang_a2a(args["all2all_backend"])
    if "speculative_config" in args:
        argv += _sglang_speculative(args["speculative_config"])
    argv += typed.write("dtype")
    if "kv_cache_dtype" in args:
        kv_dtype = args["kv_cache_dtype"]
        argv += [flag("kv_cache_dtype", "sglang"), SGLANG_KV_CACHE_DTYPES.get(kv_dtype, kv_dtype)]
    argv += typed.write("block_size", "gpu_memory_utilization", "max_model_len")
    argv += _max_num_seqs(topo, engine, plan, typed)
    argv += typed.write(
        *_BATCHING, "reasoning_parser", "tool_call_parser", "chat_template", "attention_backend"
    )
    typed.mark("enable_prefix_caching", "eplb_config")
    if args.get("enable_prefix_caching") is False:  # only "off" has a flag
        argv.append(flag("enable_prefix_caching", "sglang"))
    argv += typed.write("enforce_eager", "enable_eplb")
    eplb = args.get("eplb_config") or {}
    if "num_redundant_experts" in eplb:
        argv += [flag("eplb_config", "sglang"), str(eplb["num_redundant_experts"])]
    argv += typed.rest()
    argv += ["--host", plan.bind, "--port", str(engine.port)]
    if engine.kv is not None:
        argv += _sglang_disaggregation(topo, engine, plan)
    argv += kv_events_args(topo, engine, plan)
    _skipped(engine, not_rendered("sglang"), plan)
    argv += list(engine.extra_args)
    return argv


def _sglang_parallel(engine: Engine, plan: NodePlan, typed: _TypedArgs) -> list[str]:
    """tp, dp (DP attention), pp, ep and the nodes of a multi-host engine."""
    # With DP attention tp is the whole engine and dp splits it into attention groups
    # (seed 002: --tp 8 --dp 8 --enable-dp-attention on 8 GPUs), as the topology rules define.
    tp = engine.tp
    argv = ["--tp", str(tp)]
    if engine.dp > 1:
        argv += ["--dp", str(engine.dp)]
    argv += typed.write("enable_dp_attention")
    if engine.pp > 1:
        argv += ["--pp-size", str(engine.pp)]
    if engine.ep:
        argv += ["--ep-size", str(tp)]
    if engine.is_multi_node:
        argv += [
            "--nnodes",
            str(plan.nnodes),
            "--node-rank",
            str(plan.node_rank),
            "--dist-init-addr",
            _host_port(plan.head_address, engine.rpc_port),
        ]
    return argv


def _sglang_disaggregation(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    kv = engine.kv
    assert kv is not None
    if engine.role not in KV_ROLES:
        raise RenderError(f"engine {engine.name}: role {engine.role} takes no kv transfer")
    out = [
        "--disaggregation-mode",
        engine.role,
        "--disaggregation-transfer-backend",
        kv.connector,
    ]
    if engine.role == "prefill":
        # The bootstrap server runs on the prefill side; decode learns it per request.
        out += ["--disaggregation-bootstrap-port", str(kv.bootstrap_port)]
    rdma = topo.hosts[plan.host].rdma
    if kv.connector == "mooncake" and rdma:
        out += ["--disaggregation-ib-device", ",".join(rdma)]
    return out


def _sglang_a2a(backend: str) -> list[str]:
    modes = {"deepep_high_throughput": "normal", "deepep_low_latency": "low_latency"}
    name = flag("all2all_backend", "sglang")
    if backend in modes:
        return [name, "deepep", "--deepep-mode", modes[backend]]
    return [name, backend]


def _sglang_speculative(config: dict[str, Any]) -> list[str]:
    """vLLM-style {method, num_speculative_tokens} to SGLang's speculative flags.

    DeepSeek MTP runs as SGLang's EAGLE algorithm; k speculative tokens are k steps, top-1,
    k+1 draft tokens (seed 002: EAGLE 1/1/2).
    """
    method = str(config.get("method", "")).lower()
    algorithm = {"mtp": "EAGLE", "deepseek_mtp": "EAGLE"}.get(method, method.upper())
    out = [flag("speculative_config", "sglang"), algorithm]
    tokens = config.get("num_speculative_tokens")
    if tokens is not None:
        out += [
            "--speculative-num-steps",
            str(tokens),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(int(tokens) + 1),
        ]
    return out


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def engine_program(engine: Engine) -> list[str]:
    """The program part of the argv: `<venv>/bin/vllm serve` or, in an image, `vllm serve`."""
    name = "vllm" if engine.engine == "vllm" else "sglang"
    runtime = engine.runtime
    if runtime is None or runtime.venv is None:
        return [name, "serve"]
    return [f"{runtime.venv.rstrip('/')}/bin/{name}", "serve"]


def engine_args(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    if engine.engine == "vllm":
        return vllm_args(topo, engine, plan)
    if engine.engine == "sglang":
        return sglang_args(topo, engine, plan)
    raise RenderError(f"engine {engine.name}: unknown engine {engine.engine!r}")
