"""The proxy: hgxserve's own (unit + /etc/hgxserve/proxy.json) or vllm-router / sglang-router.

The JSON follows `hgxserve.proxy.config` (the proxy's own loader) and is checked with its
`parse_proxy_config` at render time, so a config the proxy would refuse is never rendered.

>>> unit, files = render_proxy(topo, {})  # doctest: +SKIP
>>> sorted(files)  # doctest: +SKIP
['/etc/hgxserve/proxy.json']
"""

from __future__ import annotations

import json
from typing import Any

from hgxserve.base.defaults import (
    DRAIN_OUTPUT_TOKENS,
    DRAIN_STOP_SLACK_S,
    KV_EVENTS_TOPIC,
    SGLANG_BOOTSTRAP_PORT,
)
from hgxserve.base.paths import (
    AGENT,
    AGENT_PREFIX,
    PROXY_CONFIG,
    unit_credentials_dir,
)
from hgxserve.base.units import environment_value, exec_line, path_value, signal_main_pid
from hgxserve.proxy.config import (
    ProxyConfigError,
    drain_bound,
    parse_proxy_config,
    pause_bound,
)
from hgxserve.render.types import (
    CONTAINER_TOOLS,
    CredentialSpec,
    RenderedFile,
    RenderedUnit,
    RenderError,
    add_credential,
    templates,
    unit_name,
)
from hgxserve.topology.model import Engine, SecretRef, Topology
from hgxserve.topology.placement import proxy_tokenizer
from hgxserve.topology.ports import (
    bootstrap_address,
    engine_url,
    kv_event_endpoints,
    proxy_targets,
)
from hgxserve.topology.wiring import (
    ENGINE_KEY_VAR,
    METRICS_KEY_CREDENTIAL,
    credential_for,
    proxy_key_credential,
    proxy_protocol,
    route_engines,
)

PROXY_UNIT = "hgxserve-proxy.service"
PRIVILEGED_PORTS = 1024
ROUTER_STOP_S = 60  # vllm-router / sglang-router: no drain of their own to wait for
KILL = "/bin/kill"


def drain_output_tokens(topo: Topology) -> int:
    """The most output tokens one answer through the proxy can have: the smallest context
    (max_model_len) of the engines it routes to, or DRAIN_OUTPUT_TOKENS when none states one."""
    shortest = topo.shortest_max_model_len(proxy_targets(topo))
    return shortest[0] if shortest else DRAIN_OUTPUT_TOKENS


def proxy_drains(topo: Topology) -> bool:
    """Whether the proxy drains on stop, pauses and reloads (docs/proxy.md "Drain and
    reload"): hgxserve's own, run natively (signals reach it as its unit's main process)."""
    proxy = topo.proxy
    return (
        proxy is not None
        and proxy.kind == "hgxserve"
        and not (proxy.runtime is not None and proxy.runtime.is_container)
    )


def drain_bound_s(topo: Topology) -> float:
    """Seconds the proxy gives requests in flight when it stops or pauses for a switch: the
    longest answer (drain_output_tokens) at `proxy.drain_tpot_ms`, plus a margin, at most
    `proxy.drain_max_s` (docs/proxy.md "Drain and reload")."""
    proxy = topo.proxy
    assert proxy is not None
    return drain_bound(drain_output_tokens(topo), proxy.drain_tpot_ms, proxy.drain_max_s)


def _protocol(topo: Topology) -> str:
    kinds = {topo.engines[n].engine for n in route_engines(topo) if n in topo.engines}
    if len(kinds) > 1:  # rule proxy-protocol refuses it in `validate`
        raise RenderError("proxy routes mix vLLM and SGLang engines; one protocol per proxy")
    return proxy_protocol(topo)


def _endpoint(topo: Topology, engine: Engine) -> dict[str, Any]:
    """One engine's entry: its URL and, when it publishes KV events, where (one publisher and
    one replay address per DP rank, in rank order, as the proxy's host dials them)."""
    endpoint: dict[str, Any] = {"url": engine_url(topo, engine)}
    publishers, replays = kv_event_endpoints(topo, engine)
    if publishers:
        endpoint["kv_events"] = {
            "publishers": publishers,
            "replays": replays,
            "topic": KV_EVENTS_TOPIC,
        }
    return endpoint


def _routing(topo: Topology) -> dict[str, Any]:
    """The `routing` section: the prompt-length split and every `proxy.routing` setting, each
    written out (the topology's defaults, not the proxy's, decide), and the tokenizer's
    directory (None: the approximate character index; hgxserve.topology.placement says why)."""
    proxy = topo.proxy
    assert proxy is not None
    routing = proxy.routing
    return {
        "pd_min_prompt_tokens": proxy.pd_min_prompt_tokens,
        "policy": routing.policy,
        "tokenizer_dir": proxy_tokenizer(topo)[0],
        "inflight_token_weight": routing.inflight_token_weight,
        "sticky_max_wait_ratio": routing.sticky_max_wait_ratio,
        "pd_remote_prefill_min_uncached_tokens": routing.pd_remote_prefill_min_uncached_tokens,
        "pair_max_inflight_tokens": routing.pair_max_inflight_tokens,
        "combined_max_inflight_tokens": routing.combined_max_inflight_tokens,
        "approx_ttl_s": routing.approx_ttl_s,
    }


def proxy_config(topo: Topology) -> dict[str, Any]:
    """The proxy.json document for `hgxserve proxy serve`."""
    proxy = topo.proxy
    assert proxy is not None
    protocol = _protocol(topo)
    groups = []
    for index, route in enumerate(proxy.routes):
        prefill = []
        for name in route.prefill:
            engine = topo.engines[name]
            endpoint = _endpoint(topo, engine)
            if protocol == "sglang":
                assert engine.kv is not None
                # what the decodes dial: loopback only where the prefill binds loopback
                endpoint["bootstrap_host"] = bootstrap_address(topo, engine)
                endpoint["bootstrap_port"] = engine.kv.bootstrap_port
            prefill.append(endpoint)
        decode = [_endpoint(topo, topo.engines[n]) for n in route.decode]
        group: dict[str, Any] = {"name": f"pd-{index}", "prefill": prefill, "decode": decode}
        if route.policy is not None:
            group["policy"] = route.policy
        groups.append(group)
    config: dict[str, Any] = {
        "listen": {"host": proxy.listen_host, "port": proxy.listen_port},
        "protocol": protocol,
        "served_model_name": topo.model.served_name,
        "pd_groups": groups,
        "combined": [_endpoint(topo, topo.engines[n]) for n in proxy.combined],
        "routing": _routing(topo),
        "limits": {
            "max_body_bytes": proxy.max_body,
            "prefill_timeout_s": proxy.timeout_s,
            "read_timeout_s": proxy.timeout_s,
            "drain_timeout_s": drain_bound_s(topo),
            "pause_max_s": pause_bound(
                max((e.start_timeout_s for e in topo.engines.values()), default=0),
                drain_bound_s(topo),
            ),
        },
    }
    if proxy.combined_policy is not None:
        config["combined_policy"] = proxy.combined_policy
    auth: dict[str, str] = {}
    if proxy.api_key is not None:
        auth["api_key_file"] = f"{unit_credentials_dir(PROXY_UNIT)}/{_api_key_name(topo)}"
    engine_key = _engine_key_credential(topo)
    if engine_key is not None:
        auth["upstream_api_key_file"] = f"{unit_credentials_dir(PROXY_UNIT)}/{engine_key[0]}"
    if proxy.metrics_key is not None:
        name = proxy_key_credential(proxy.metrics_key, METRICS_KEY_CREDENTIAL)[0]
        auth["metrics_key_file"] = f"{unit_credentials_dir(PROXY_UNIT)}/{name}"
    if auth:
        config["auth"] = auth
    return config


def _engine_key_credential(topo: Topology) -> tuple[str, str, str | None] | None:
    """(name, LoadCredential= value, file the release role writes) of the engines' key: the
    same credential the engine units load, so one file serves both on the proxy's host."""
    proxy = topo.proxy
    if proxy is None or proxy.engine_api_key is None:
        return None
    return credential_for(ENGINE_KEY_VAR, proxy.engine_api_key)


def _api_key_name(topo: Topology) -> str:
    proxy = topo.proxy
    assert proxy is not None and proxy.api_key is not None
    return proxy_key_credential(proxy.api_key)[0]


def _router_argv(topo: Topology) -> list[str]:
    proxy = topo.proxy
    assert proxy is not None
    if proxy.api_key is not None or proxy.engine_api_key is not None:
        raise RenderError(  # rule proxy-router-auth refuses it in `validate`
            f"proxy kind {proxy.kind} takes its API keys only on the command line, where they "
            "would leak; use kind hgxserve for auth, or drop proxy.auth"
        )
    if proxy.routes and proxy.combined:
        raise RenderError(  # rule proxy-router-mix
            f"proxy kind {proxy.kind} cannot mix P/D routes and combined engines "
            "(no prompt-length buckets); use kind hgxserve"
        )
    runtime = proxy.runtime
    venv = runtime.venv if runtime and runtime.venv else AGENT_PREFIX
    prefills = [topo.engines[n] for r in proxy.routes for n in r.prefill]
    decodes = [topo.engines[n] for r in proxy.routes for n in r.decode]
    combined = [topo.engines[n] for n in proxy.combined]
    listen = ["--host", proxy.listen_host, "--port", str(proxy.listen_port)]
    if proxy.kind == "vllm-router":
        argv = [f"{venv}/bin/vllm-router", "--policy", "consistent_hash"]
        if prefills:
            kv = prefills[0].kv
            connector = kv.connector if kv else "nixl"
            argv += ["--vllm-pd-disaggregation", "--kv-connector", connector]
            for engine in _unique(prefills):
                argv += ["--prefill", engine_url(topo, engine)]
            for engine in _unique(decodes):
                argv += ["--decode", engine_url(topo, engine)]
            local_dp = max(max(len(e.dp_ranks_on(e.head)), 1) for e in _unique(prefills + decodes))
            argv += ["--intra-node-data-parallel-size", str(local_dp)]
        else:
            argv += ["--worker-urls", *[engine_url(topo, e) for e in combined]]
        return argv + listen + ["--request-timeout-secs", str(int(proxy.timeout_s))]
    argv = [f"{venv}/bin/python", "-m", "sglang_router.launch_router"]
    if prefills:
        argv.append("--pd-disaggregation")
        for engine in _unique(prefills):
            port = engine.kv.bootstrap_port if engine.kv else SGLANG_BOOTSTRAP_PORT
            # sglang-router hands the decodes this URL's host as bootstrap_host, so it is the
            # address they dial (the host's own unless the prefill binds loopback), not the
            # router's loopback view of its neighbour
            argv += ["--prefill", engine_url(topo, engine, from_host=""), str(port)]
        for engine in _unique(decodes):
            argv += ["--decode", engine_url(topo, engine)]
    else:
        argv += ["--worker-urls", *[engine_url(topo, e) for e in combined]]
    return argv + listen


def _unique(engines: list[Engine]) -> list[Engine]:
    seen: dict[str, Engine] = {}
    for engine in engines:
        seen.setdefault(engine.name, engine)
    return list(seen.values())


def _stop_s(topo: Topology) -> int:
    """The proxy unit's TimeoutStopSec= (the container's stop time: the same): past the
    hgxserve proxy's drain bound, so it exits by itself first."""
    proxy = topo.proxy
    assert proxy is not None
    if proxy.kind != "hgxserve":
        return ROUTER_STOP_S
    return int(drain_bound_s(topo)) + DRAIN_STOP_SLACK_S


def _proxy_credentials(topo: Topology, creds: dict[str, CredentialSpec]) -> list[tuple[str, str]]:
    """(LoadCredential= value, unit note) of each key the hgxserve proxy loads, recorded in
    `creds`: the clients' key, the engines' key, the /metrics key."""
    proxy = topo.proxy
    assert proxy is not None
    keys: list[tuple[SecretRef, tuple[str, str, str | None], str]] = []
    if proxy.api_key is not None:
        note = "API key: systemd credential, read from $CREDENTIALS_DIRECTORY"
        keys.append((proxy.api_key, proxy_key_credential(proxy.api_key), note))
    engine_key = _engine_key_credential(topo)
    if engine_key is not None:
        assert proxy.engine_api_key is not None
        note = "engine key: systemd credential, sent to every engine as a Bearer token"
        keys.append((proxy.engine_api_key, engine_key, note))
    if proxy.metrics_key is not None:
        note = "/metrics key: systemd credential, read from $CREDENTIALS_DIRECTORY"
        keys.append(
            (
                proxy.metrics_key,
                proxy_key_credential(proxy.metrics_key, METRICS_KEY_CREDENTIAL),
                note,
            )
        )
    out = []
    for ref, (name, line, path), note in keys:
        add_credential(creds, PROXY_UNIT, name, ref, path)
        out.append((line, note))
    return out


def render_proxy(
    topo: Topology, creds: dict[str, CredentialSpec]
) -> tuple[RenderedUnit, dict[str, RenderedFile]]:
    """The proxy unit and, for kind hgxserve, /etc/hgxserve/proxy.json."""

    proxy = topo.proxy
    assert proxy is not None
    files: dict[str, RenderedFile] = {}
    notes: list[str] = []
    credentials: list[str] = []
    routed = proxy_targets(topo)
    local = [
        unit_name(e.name)
        for e in topo.engines.values()
        if e.name in routed and proxy.host in e.place
    ]
    if proxy.kind == "hgxserve":
        config = proxy_config(topo)
        try:
            parse_proxy_config(config)
        except ProxyConfigError as exc:
            raise RenderError(f"rendered proxy config is invalid:\n{exc}") from exc
        files[PROXY_CONFIG] = RenderedFile(json.dumps(config, indent=2) + "\n")
        argv = [AGENT, "proxy", "serve", "--config", PROXY_CONFIG]
        for line, note in _proxy_credentials(topo, creds):
            if path_value(line) not in credentials:
                credentials.append(path_value(line))
            notes.append(note)
    else:
        argv = _router_argv(topo)
        notes.append(f"{proxy.kind}: no prompt-length buckets, no combined fallback")
    exec_stop: list[str] = []
    stop_s = _stop_s(topo)
    runtime = proxy.runtime
    in_container = runtime is not None and runtime.is_container
    if not in_container:
        notes.append("runs as an unprivileged dynamic user; credentials stay readable to it")
    if runtime is not None and runtime.is_container:
        tool = CONTAINER_TOOLS[runtime.tool or "podman"]
        name = "hgxserve-proxy"
        argv = [
            tool,
            "run",
            "--pull=never",  # loaded by digest in the runtime stage, never during a switch
            "--rm",
            "--name",
            name,
            "--network",
            "host",
            "--entrypoint",
            argv[0].rsplit("/", 1)[-1],
            str(runtime.image),
            *argv[1:],
        ]
        exec_stop.append(exec_line([tool, "stop", "--time", str(stop_s), name]))
        stop_s += DRAIN_STOP_SLACK_S
    listen = f"{proxy.listen_host}:{proxy.listen_port}"
    content = (
        templates()
        .get_template("proxy.service.j2")
        .render(
            topology=topo.name,
            kind=proxy.kind,
            listen=listen,
            notes=notes,
            description=f"hgxserve proxy ({proxy.kind}) on {listen} for {topo.model.served_name}",
            after=["network-online.target", *local],
            environment=[environment_value("HF_HUB_OFFLINE", "1")],
            credentials=credentials,
            exec_start_pre=[],
            exec_start=exec_line(argv),
            exec_reload=signal_main_pid(KILL, "HUP") if proxy_drains(topo) else None,
            exec_stop=exec_stop,
            timeout_stop_s=stop_s,
            exec_stop_post=[],
            # podman/docker need root; a native proxy needs nothing of it
            dynamic_user=not in_container,
            # ports below 1024 need this one capability, and then nothing else
            bind_privileged=proxy.listen_port < PRIVILEGED_PORTS,
        )
    )
    unit = RenderedUnit(
        name=PROXY_UNIT,
        engine=None,
        role="proxy",
        argv=argv,
        env={"HF_HUB_OFFLINE": "1"},
        gpus=(),
        content=content,
    )
    return unit, files
