"""The typed topology: what the renderer, rules and deploys work from.

Built only from a document that passed the schema. Defaults come from the schema's `default`
keywords, so each default is written in one place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from hgxserve.base.defaults import schema_default
from hgxserve.base.paths import TOPOLOGY_FILES_DIR
from hgxserve.base.routing import is_kv_aware
from hgxserve.base.sizes import parse_size
from hgxserve.topology.engine_args import EngineArgs, EngineKind
from hgxserve.topology.engine_flags import read_extra_args

LOOPBACK = ("127.", "localhost", "::1")
# Engine flags whose value is a file or directory the engine reads on its host.
PATH_FLAGS = (
    "--chat-template",
    "--tool-parser-plugin",
    "--reasoning-parser-plugin",
    "--generation-config",
    "--hf-config-path",
    "--tokenizer",
)

# The fixed vocabularies of the schema's enums (tests/structure/test_vocabularies.py keeps
# each equal to its enum).
Role = Literal["combined", "prefill", "decode"]
# EngineKind: hgxserve.topology.engine_args, beside the table of the args of each engine
KvConnector = Literal["nixl", "mooncake"]
KvFailurePolicy = Literal["fail", "recompute"]
KvBufferDevice = Literal["cuda", "cpu"]
ProxyKind = Literal["hgxserve", "vllm-router", "sglang-router"]
TokenizerSource = Literal["weights", "none"]
Addressing = Literal["virtual", "path", "auto"]
CacheMode = Literal["off", "restore", "bake", "auto"]
CacheDistribute = Literal["controller", "s3"]
WarmupApi = Literal["completions", "chat"]
SecretKind = Literal["env", "file", "credential"]
ContainerTool = Literal["podman", "docker"]
DcgmSource = Literal["package", "container"]
# A routing policy's name: one of hgxserve.base.routing.POLICY_NAMES, where the names are
# written (test_vocabularies.py keeps them equal to the schema's $defs.routingPolicy enum).
RoutingPolicy = str
# Top-level keys that change nothing the hosts serve: not part of the topology digest.
UNSERVED_KEYS = ("monitoring",)


def is_loopback(address: str) -> bool:
    return address.startswith(LOOPBACK)


def _get(data: dict[str, Any], definition: str, prop: str) -> Any:
    return data[prop] if prop in data else schema_default(definition, prop)


def _defaulted(data: dict[str, Any], definition: str, props: str) -> dict[str, Any]:
    """Each of `props` (names separated by spaces) as written, or the schema's default for it:
    keyword arguments for the fields of the same names."""
    return {prop: _get(data, definition, prop) for prop in props.split()}


@dataclass(frozen=True)
class SecretRef:
    """Where a secret comes from: env (controller variable), file (on host) or credential."""

    kind: SecretKind
    value: str

    @classmethod
    def parse(cls, data: dict[str, Any]) -> SecretRef:
        ((kind, value),) = data.items()
        return cls(cast(SecretKind, kind), value)  # the schema allows only these keys


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    gpu: str
    gpus: int
    rdma: tuple[str, ...]
    side_channel_address: str
    shm: int | None
    ssh_user: str
    ssh_port: int
    ssh_key: str | None


@dataclass(frozen=True)
class S3Source:
    endpoint: str | None
    bucket: str
    prefix: str
    region: str
    addressing: Addressing
    credentials: tuple[str, str] | None  # (env_file|profile|chain, value)
    concurrency: int
    part_size: int  # bytes per ranged GET: the schema's "32Mi" parsed once, here

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class CephfsSource:
    monitors: tuple[str, ...]
    path: str
    user: str
    secret: SecretRef
    mount: str
    stage: bool


@dataclass(frozen=True)
class LocalSource:
    path: str


ModelSource = S3Source | CephfsSource | LocalSource


@dataclass(frozen=True)
class Architecture:
    attention_heads: int | None = None
    kv_heads: int | None = None
    layers: int | None = None
    attention: str | None = None


@dataclass(frozen=True)
class Model:
    name: str
    served_name: str
    path: str
    size: int | None
    architecture: Architecture
    source: ModelSource
    manifest: str
    config: str | None = None  # config.json for the fit estimate (hgxserve.topology.fit)
    integrity: str = "sha256"  # sha256 | size-etag (explicit opt-out)
    digest: str | None = None  # pinned manifest digest (sha256:...)
    digest_from: str | None = None  # "inventory": the pin is in the inventory's pins file


# A wheel's file name: distribution, version, optional build tag, python, abi, platform.
_WHEEL_NAME = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._]*)-([A-Za-z0-9.+!_]+)(-[^-]+)?-[^-]+-[^-]+-[^-]+\.whl$"
)


def normalize_dist(name: str) -> str:
    """A distribution name as PEP 503 compares them.

    >>> normalize_dist("Deep_GEMM")
    'deep-gemm'
    """
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class RuntimeWheel:
    """`runtime.wheels[]`: one wheel file pinned by sha256, from the weights' S3 (`url`) or
    from the controller (`file`, resolved against the topology's folder when installing)."""

    sha256: str
    url: str | None = None  # s3://bucket/key.whl
    file: str | None = None  # as written in the topology

    @property
    def filename(self) -> str:
        return str(self.url or self.file).rstrip("/").rsplit("/", 1)[-1]

    @property
    def dist(self) -> str:
        """The wheel's distribution name, normalised (`deep-ep` for deep_ep-1.2.1-...whl)."""
        match = _WHEEL_NAME.match(self.filename)
        return normalize_dist(match.group(1)) if match else ""

    @property
    def version(self) -> str:
        match = _WHEEL_NAME.match(self.filename)
        return match.group(2) if match else ""


@dataclass(frozen=True)
class Runtime:
    venv: str | None = None
    image: str | None = None
    tool: ContainerTool | None = None
    cuda: str | None = None  # CUDA version the runtime was built for
    packages: tuple[str, ...] = ()
    wheels: tuple[RuntimeWheel, ...] = ()

    def provides(self) -> set[str]:
        """Normalised distribution names `packages` and `wheels` put into the venv."""
        names = {normalize_dist(p.split("==", 1)[0]) for p in self.packages}
        return names | {w.dist for w in self.wheels}

    @property
    def is_container(self) -> bool:
        return self.image is not None


# UCX_TLS names of transports that use an RDMA NIC (UCX's `ucx_info -d` transport names and the
# aliases UCX_TLS accepts); "all" lets UCX pick one.
UCX_RDMA_TLS = frozenset(
    {"all", "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
     "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5"}
)  # fmt: skip


@dataclass(frozen=True)
class KvTransfer:
    connector: KvConnector
    side_channel_host: str | None  # as written; None or "auto": routable when KV crosses hosts
    # (resolve with hgxserve.topology.ports.side_channel_host)
    side_channel_port: int
    ucx_devices: str | tuple[str, ...] | None
    ucx_tls: tuple[str, ...] | None
    buffer_device: KvBufferDevice
    failure_policy: KvFailurePolicy
    bootstrap_port: int

    @property
    def ucx_tcp_only(self) -> bool:
        """NIXL whose `ucx_tls` names no RDMA transport: KV between hosts can only go over TCP
        (unset, or `^exclusions`, leaves UCX free to pick RDMA)."""
        names = [t.strip().lower() for t in self.ucx_tls or () if t.strip()]
        if self.connector != "nixl" or not names or names[0].startswith("^"):
            return False
        return not any(name in UCX_RDMA_TLS for name in names)


@dataclass(frozen=True)
class KvEventsPorts:
    """`kv_events:` as written: the publisher's and the replay listener's base ports (None: the
    default hgxserve.topology.ports derives from the engine's port)."""

    port: int | None = None
    replay_port: int | None = None


@dataclass(frozen=True)
class Engine:
    """One engine instance: one OpenAI API endpoint, on one or several hosts."""

    name: str
    role: Role
    engine: EngineKind
    version: str | None
    runtime: Runtime | None
    place: dict[str, tuple[int, ...]]
    tp: int
    dp: int
    pp: int
    ep: bool
    port: int
    bind: str | None
    internal_port: int | None
    rpc_port: int
    watch_port: int  # the multi-node engine's watcher (hgxserve.release.watch), on every host
    kv: KvTransfer | None
    args: EngineArgs
    extra_args: tuple[str, ...]
    env: dict[str, str]
    secret_env: dict[str, SecretRef]
    start_timeout_s: int  # TimeoutStartSec= and the release's health wait
    kv_events: KvEventsPorts = field(default_factory=KvEventsPorts)

    @property
    def hosts(self) -> list[str]:
        """Host names in placement order; the first is the head."""
        return list(self.place)

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def is_multi_node(self) -> bool:
        return len(self.place) > 1

    @property
    def gpu_count(self) -> int:
        return sum(len(g) for g in self.place.values())

    @property
    def dp_attention(self) -> bool:
        """SGLang DP attention: the dp attention groups live inside tp (tp GPUs in all)."""
        return self.engine == "sglang" and bool(self.args.get("enable_dp_attention"))

    @property
    def redundant_experts(self) -> int:
        """Redundant experts per MoE layer EPLB adds (0 without EPLB)."""
        if not self.args.get("enable_eplb"):
            return 0
        return int(self.args.get("eplb_config", {}).get("num_redundant_experts") or 0)

    @property
    def gpus_per_dp_rank(self) -> int:
        """GPUs one data-parallel rank uses (tp x pp; tp/dp x pp with SGLang DP attention)."""
        if self.dp_attention and self.dp > 0 and self.tp % self.dp == 0:
            return self.tp // self.dp * self.pp
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        """GPUs the engine needs: tp x dp x pp (tp x pp with SGLang DP attention)."""
        return self.gpus_per_dp_rank * self.dp

    def extra_arg(self, *flags: str) -> str | None:
        """The value one of `flags` sets in extra_args (`--flag v` or `--flag=v`), if any, in
        any spelling the engine's parser takes for it (hgxserve.topology.engine_flags)."""
        wanted = set(flags)
        for found in read_extra_args(self.engine, self.extra_args):
            names = {found.written, found.name, found.flag}
            if not found.subkey and found.value and wanted & names:
                return found.value
        return None

    def host_paths(self) -> list[tuple[tuple[str, ...], str, str]]:
        """(setting keys, flag, path) of every absolute host path the engine's args name."""
        found: list[tuple[tuple[str, ...], str, str]] = []
        template = self.args.get("chat_template")
        if template is not None and template.startswith("/"):
            found.append((("args", "chat_template"), "chat_template", template))
        for arg in read_extra_args(self.engine, self.extra_args):
            flag = arg.flag or arg.name
            if flag not in PATH_FLAGS or not arg.value.startswith("/"):
                continue
            eq = "=" in self.extra_args[arg.index]
            found.append((("extra_args", str(arg.index if eq else arg.index + 1)), flag, arg.value))
        return found

    def dp_ranks_on(self, host: str) -> range:
        """Data-parallel ranks that run on `host` (ranks are laid out in placement order)."""
        per_rank = self.gpus_per_dp_rank
        start = 0
        for name, gpus in self.place.items():
            count = len(gpus) // per_rank if per_rank else 0
            if name == host:
                return range(start, start + count)
            start += count
        return range(0)


@dataclass(frozen=True)
class Route:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    policy: RoutingPolicy | None = None  # None: proxy.routing.policy


@dataclass(frozen=True)
class Routing:
    """`proxy.routing:`: the hgxserve proxy's routing policy and bounds; each default is the
    schema's (`Routing.parse({})`), written there once."""

    policy: RoutingPolicy
    tokenizer: TokenizerSource
    inflight_token_weight: float
    sticky_max_wait_ratio: float
    pd_remote_prefill_min_uncached_tokens: int
    pair_max_inflight_tokens: int
    combined_max_inflight_tokens: int
    approx_ttl_s: float

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Routing:
        return cls(**_defaulted(data, "routing", ROUTING_KEYS))


# the keys of `proxy.routing`, in the order proxy.json writes them
ROUTING_KEYS = (
    "policy tokenizer inflight_token_weight sticky_max_wait_ratio "
    "pd_remote_prefill_min_uncached_tokens pair_max_inflight_tokens "
    "combined_max_inflight_tokens approx_ttl_s"
)


@dataclass(frozen=True)
class Proxy:
    host: str
    listen_host: str
    listen_port: int
    kind: ProxyKind
    routes: tuple[Route, ...]
    combined: tuple[str, ...]
    pd_min_prompt_tokens: int
    api_key: SecretRef | None
    engine_api_key: SecretRef | None
    max_body: int
    timeout_s: float
    runtime: Runtime | None
    drain_tpot_ms: float = 40.0  # the schema's defaults; _proxy reads them from there
    drain_max_s: float = 900.0
    metrics_key: SecretRef | None = None  # GET /metrics wants it (proxy.auth.metrics_key)
    routing: Routing = field(default_factory=lambda: Routing.parse({}))
    combined_policy: RoutingPolicy | None = None  # None: routing.policy

    def route_policy(self, route: Route) -> RoutingPolicy:
        """The policy of one P/D route: its own, else `routing.policy`."""
        return route.policy or self.routing.policy

    @property
    def combined_route_policy(self) -> RoutingPolicy:
        """The policy of the combined engines: `combined_policy`, else `routing.policy`."""
        return self.combined_policy or self.routing.policy

    def kv_aware(self, route: Route) -> bool:
        """True when one P/D route's policy routes by the prompt prefixes its engines hold
        cached (a vLLM decode then prefills a prompt few of whose tokens it lacks: `pd-local`)."""
        return is_kv_aware(self.route_policy(route))


@dataclass(frozen=True)
class Warmup:
    input: int
    output: int
    concurrency: int
    api: WarmupApi


@dataclass(frozen=True)
class CachePolicy:
    policy: CacheMode
    root: str
    distribute: CacheDistribute
    s3_prefix: str | None


@dataclass(frozen=True)
class TopologyFile:
    """A file the engines need on their hosts, shipped to `host_path` by the runtime stage."""

    name: str
    source: str  # an https:// URL, or a controller path resolved against the topology's folder
    sha256: str

    @property
    def is_url(self) -> bool:
        return self.source.startswith(("https://", "http://"))

    @property
    def host_path(self) -> str:
        return f"{TOPOLOGY_FILES_DIR}/{self.name}"


@dataclass(frozen=True)
class BenchGate:
    """`gate.bench:`: the bench scenario a release must pass after the probes."""

    scenario: str
    max_regression_pct: float | None
    timeout_s: int

    @classmethod
    def parse(cls, data: dict[str, Any]) -> BenchGate:
        return cls(
            scenario=data["scenario"],
            max_regression_pct=data.get("max_regression_pct"),
            timeout_s=_get(data, "gate_bench", "timeout_s"),
        )


@dataclass(frozen=True)
class GatePolicy:
    """`gate:`: what the release gate must see (defaults from the schema)."""

    prompt: str
    expect: str
    expect_regex: str | None
    max_tokens: int
    chat: bool
    stream: bool
    reasoning: str  # auto | on | off
    tool_call: str  # auto | on | off
    rdma: str  # auto | off
    kv_capacity: str  # fail | warn | off: the engines' reported KV against the shapes' need
    fabric: str  # fail | warn | off: the fabric preflight before a release that crosses hosts
    from_host: str | None
    timeout_s: int
    bench: BenchGate | None = None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> GatePolicy:
        return cls(
            **_defaulted(
                data,
                "gate",
                "prompt expect max_tokens chat stream reasoning tool_call rdma kv_capacity "
                "fabric timeout_s",
            ),
            expect_regex=data.get("expect_regex"),
            from_host=data.get("from"),
            bench=BenchGate.parse(data["bench"]) if data.get("bench") else None,
        )


@dataclass(frozen=True)
class MonitoringSla:
    percentile: int
    ttft_s: float | None
    tpot_ms: float | None
    error_rate: float


@dataclass(frozen=True)
class Monitoring:
    """`monitoring:`: exporters, the Prometheus that scrapes them, rule thresholds."""

    prometheus_host: str | None  # None: only drop-in files for an existing Prometheus
    prometheus_port: int
    retention: str
    scrape_interval_s: int
    evaluation_interval_s: int
    alert_for_s: int
    node_exporter: bool
    node_exporter_port: int
    dcgm_exporter: bool
    dcgm_exporter_port: int
    dcgm_source: DcgmSource
    dcgm_image: str | None
    sla: MonitoringSla
    kv_cache_full: float
    gpu_idle_util: float
    gpu_temp_c: int

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Monitoring:
        prom = data.get("prometheus", {})
        node = data.get("node_exporter", {})
        dcgm = data.get("dcgm_exporter", {})
        sla = data.get("sla", {})
        return cls(
            prometheus_host=prom.get("host"),
            prometheus_port=_get(prom, "monitoringPrometheus", "port"),
            retention=_get(prom, "monitoringPrometheus", "retention"),
            **_defaulted(
                data,
                "monitoring",
                "scrape_interval_s evaluation_interval_s alert_for_s kv_cache_full gpu_idle_util "
                "gpu_temp_c",
            ),
            node_exporter=_get(node, "monitoringExporter", "enabled"),
            node_exporter_port=_get(node, "monitoringExporter", "port"),
            dcgm_exporter=_get(dcgm, "monitoringDcgm", "enabled"),
            dcgm_exporter_port=_get(dcgm, "monitoringDcgm", "port"),
            dcgm_source=_get(dcgm, "monitoringDcgm", "source"),
            dcgm_image=dcgm.get("image"),
            sla=MonitoringSla(
                percentile=_get(sla, "monitoringSla", "percentile"),
                ttft_s=sla.get("ttft_s"),
                tpot_ms=sla.get("tpot_ms"),
                error_rate=_get(sla, "monitoringSla", "error_rate"),
            ),
        )


@dataclass(frozen=True)
class Firewall:
    """`firewall:`: the nftables table hgxserve renders from the port plan (on by default)."""

    enabled: bool = True
    reason: str | None = None  # why it is off
    allow: tuple[str, ...] = ()  # further sources allowed on every filtered port

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Firewall:
        return cls(
            enabled=_get(data, "firewall", "enabled"),
            reason=data.get("reason"),
            allow=tuple(data.get("allow", ())),
        )


@dataclass(frozen=True)
class Topology:
    """A validated topology."""

    name: str
    description: str
    baseline: bool
    hosts: dict[str, Host]
    model: Model
    engines: dict[str, Engine]
    proxy: Proxy | None
    warmup: tuple[Warmup, ...]
    cache: CachePolicy
    gate: GatePolicy
    files: dict[str, TopologyFile] = field(default_factory=dict)
    monitoring: Monitoring | None = None
    firewall: Firewall = field(default_factory=Firewall)
    source_file: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def digest(self) -> str:
        """sha256 of the topology's canonical JSON: changes exactly when what the hosts serve
        changes. `monitoring:` is left out, so a new alert threshold never starts a release."""
        served = {k: v for k, v in self.raw.items() if k not in UNSERVED_KEYS}
        canon = json.dumps(served, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def engines_on(self, host: str) -> list[Engine]:
        return [e for e in self.engines.values() if host in e.place]

    def shortest_max_model_len(self, names: Iterable[str]) -> tuple[int, str] | None:
        """The smallest `max_model_len` among the engines named (names of no engine are left
        out) and the engine that has it (the first by name on a tie); None when none sets it.
        An integer the YAML wrote as `8192.0` (the schema takes it) counts as 8192."""
        return min(
            (
                (int(e.args["max_model_len"]), n)
                for n in names
                if (e := self.engines.get(n)) is not None and "max_model_len" in e.args
            ),
            default=None,
        )

    def hosts_in_use(self) -> list[str]:
        used = {h for e in self.engines.values() for h in e.place}
        if self.proxy:
            used.add(self.proxy.host)
        return [h for h in self.hosts if h in used]


def _runtime(data: dict[str, Any] | None) -> Runtime | None:
    if data is None:
        return None
    if "venv" in data:
        return Runtime(
            venv=data["venv"],
            cuda=data.get("cuda"),
            packages=tuple(data.get("packages", ())),
            wheels=tuple(
                RuntimeWheel(w["sha256"], url=w.get("url"), file=w.get("file"))
                for w in data.get("wheels", ())
            ),
        )
    return Runtime(
        image=data["image"], tool=_get(data, "imageRuntime", "tool"), cuda=data.get("cuda")
    )


def _host(name: str, data: dict[str, Any]) -> Host:
    ssh = data.get("ssh", {})
    return Host(
        name=name,
        address=data["address"],
        gpu=data["gpu"],
        gpus=_get(data, "host", "gpus"),
        rdma=tuple(data.get("rdma", ())),
        side_channel_address=data.get("side_channel_address", data["address"]),
        shm=parse_size(data["shm"]) if "shm" in data else None,
        ssh_user=_get(ssh, "ssh", "user"),
        ssh_port=_get(ssh, "ssh", "port"),
        ssh_key=ssh.get("key"),
    )


def _source(data: dict[str, Any]) -> ModelSource:
    ((kind, spec),) = data.items()
    if kind == "s3":
        creds = spec.get("credentials")
        return S3Source(
            endpoint=spec.get("endpoint"),
            bucket=spec["bucket"],
            prefix=_get(spec, "s3Source", "prefix"),
            region=_get(spec, "s3Source", "region"),
            addressing=_get(spec, "s3Source", "addressing"),
            credentials=next(iter(creds.items())) if creds else None,
            concurrency=_get(spec, "s3Source", "concurrency"),
            part_size=parse_size(_get(spec, "s3Source", "part_size")),
        )
    if kind == "cephfs":
        return CephfsSource(
            monitors=tuple(spec["monitors"]),
            path=spec["path"],
            user=spec["user"],
            secret=SecretRef.parse(spec["secret"]),
            mount=_get(spec, "cephfsSource", "mount"),
            stage=_get(spec, "cephfsSource", "stage"),
        )
    return LocalSource(path=spec["path"])


def _model(data: dict[str, Any]) -> Model:
    return Model(
        name=data["name"],
        served_name=data["served_name"],
        path=data["path"],
        size=parse_size(data["size"]) if "size" in data else None,
        architecture=Architecture(**data.get("architecture", {})),
        source=_source(data["source"]),
        manifest=_get(data, "model", "manifest"),
        config=data.get("config"),
        integrity=_get(data, "model", "integrity"),
        digest=data.get("digest"),
        digest_from=data.get("digest_from"),
    )


def _kv(data: dict[str, Any] | None) -> KvTransfer | None:
    if data is None:
        return None
    side = data.get("side_channel", {})
    devices = data.get("ucx_devices")
    return KvTransfer(
        **_defaulted(data, "kv", "connector buffer_device failure_policy bootstrap_port"),
        side_channel_host=side.get("host"),
        side_channel_port=_get(side, "sideChannel", "port"),
        ucx_devices=tuple(devices) if isinstance(devices, list) else devices,
        ucx_tls=tuple(data["ucx_tls"]) if "ucx_tls" in data else None,
    )


def merge_engine(defaults: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """An engine's settings over the topology defaults: args and env key by key,
    extra_args appended, everything else replaced."""
    merged = {**defaults, **data}
    for key in ("args", "env", "secret_env"):
        merged[key] = {**defaults.get(key, {}), **data.get(key, {})}
    merged["extra_args"] = [*defaults.get("extra_args", []), *data.get("extra_args", [])]
    return merged


def _engine(name: str, data: dict[str, Any]) -> Engine:
    return Engine(
        name=name,
        role=data["role"],
        **_defaulted(data, "engine", "engine tp dp pp ep rpc_port watch_port start_timeout_s"),
        version=data.get("version"),
        runtime=_runtime(data.get("runtime")),
        place={h: tuple(g) for h, g in data["place"].items()},
        port=data["port"],
        bind=data.get("bind"),
        internal_port=data.get("internal_port"),
        kv=_kv(data.get("kv")),
        args=cast(EngineArgs, dict(data.get("args", {}))),  # the schema checked each arg
        extra_args=tuple(data.get("extra_args", ())),
        env={k: _env_text(v) for k, v in data.get("env", {}).items()},
        secret_env={k: SecretRef.parse(v) for k, v in data.get("secret_env", {}).items()},
        kv_events=KvEventsPorts(**data.get("kv_events", {})),
    )


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _proxy(data: dict[str, Any] | None) -> Proxy | None:
    if data is None:
        return None
    listen = _get(data, "proxy", "listen")
    host, _, port = listen.rpartition(":")
    auth = data.get("auth")
    return Proxy(
        host=data["host"],
        listen_host=host.strip("[]"),
        listen_port=int(port),
        kind=_get(data, "proxy", "kind"),
        routes=tuple(
            Route(tuple(r["prefill"]), tuple(r["decode"]), r.get("policy"))
            for r in data.get("routes", ())
        ),
        combined=tuple(data.get("combined", ())),
        pd_min_prompt_tokens=_get(data, "proxy", "pd_min_prompt_tokens"),
        api_key=SecretRef.parse(auth["api_key"]) if auth else None,
        engine_api_key=(
            SecretRef.parse(auth["engine_api_key"]) if auth and "engine_api_key" in auth else None
        ),
        max_body=parse_size(_get(data, "proxy", "max_body")),
        timeout_s=float(_get(data, "proxy", "timeout_s")),
        runtime=_runtime(data.get("runtime")),
        drain_tpot_ms=float(_get(data, "proxy", "drain_tpot_ms")),
        drain_max_s=float(_get(data, "proxy", "drain_max_s")),
        metrics_key=(
            SecretRef.parse(auth["metrics_key"]) if auth and "metrics_key" in auth else None
        ),
        routing=Routing.parse(data.get("routing", {})),
        combined_policy=data.get("combined_policy"),
    )


def build_topology(data: dict[str, Any], source_file: str = "") -> Topology:
    """Build the typed Topology from schema-valid data.

    >>> topo = build_topology(doc.data)  # doctest: +SKIP
    >>> topo.engines["decode-0"].gpu_count  # doctest: +SKIP
    4
    """
    defaults = data.get("defaults", {})
    cache_data = data.get("cache", {})
    return Topology(
        name=data["name"],
        description=data.get("description", ""),
        baseline=data.get("baseline", False),
        hosts={n: _host(n, h) for n, h in data["hosts"].items()},
        model=_model(data["model"]),
        engines={n: _engine(n, merge_engine(defaults, e)) for n, e in data["engines"].items()},
        proxy=_proxy(data.get("proxy")),
        warmup=tuple(
            Warmup(
                w["input"],
                w["output"],
                _get(w, "warmup", "concurrency"),
                _get(w, "warmup", "api"),
            )
            for w in data.get("warmup", ())
        ),
        cache=CachePolicy(
            **_defaulted(cache_data, "cache", "policy root distribute"),
            s3_prefix=cache_data.get("s3_prefix"),
        ),
        files=_files(data.get("files", {}), source_file),
        monitoring=Monitoring.parse(data["monitoring"]) if "monitoring" in data else None,
        gate=GatePolicy.parse(data.get("gate", {})),
        firewall=Firewall.parse(data.get("firewall", {})),
        source_file=source_file,
        raw=data,
    )


def _files(data: dict[str, Any], source_file: str) -> dict[str, TopologyFile]:
    base = os.path.dirname(os.path.abspath(source_file)) if source_file else os.getcwd()
    return {
        name: TopologyFile(
            name,
            spec["source"]
            if spec["source"].startswith(("https://", "http://"))
            else os.path.join(base, spec["source"]),
            spec["sha256"],
        )
        for name, spec in sorted(data.items())
    }
