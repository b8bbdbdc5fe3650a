"""Render a validated topology into what each host runs: systemd units and config files.

Pure Python, no host access. `render_topology(topo)` gives one `HostRender` per host in use;
its `files` map absolute paths on the host to content and mode, its `units` list the engine
units (in topology order) and then the proxy unit, each with the argv and environment it runs.

>>> from hgxserve.topology import load_topology
>>> topo = load_topology("topologies/h20-v4flash-4p4d.yml")  # doctest: +SKIP
>>> host = render_host(topo, "h20-a")  # doctest: +SKIP
>>> [u.name for u in host.units]  # doctest: +SKIP
['hgxserve-prefill-0.service', 'hgxserve-decode-0.service', 'hgxserve-proxy.service']
>>> sorted(host.files)[0]  # doctest: +SKIP
'/etc/hgxserve/proxy.json'
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from hgxserve.base import paths
from hgxserve.base.cachelayout import ENV_SUBDIRS, cache_env
from hgxserve.base.defaults import ENGINE_USER
from hgxserve.base.enginekey import keyed_sglang_command
from hgxserve.base.paths import AGENT
from hgxserve.base.units import (
    UnitText,
    UnitValueError,
    environment_value,
    exec_line,
    mount_unit_name,
    path_list,
    path_value,
)
from hgxserve.caches.key import cache_key
from hgxserve.caches.warmup import Shape, shapes_arg, warmup_plan
from hgxserve.render.engines import NodePlan, engine_args, engine_program, node_plan
from hgxserve.render.firewall import render_firewall
from hgxserve.render.proxy import render_proxy
from hgxserve.render.types import (
    CONTAINER_TOOLS,
    CredentialSpec,
    HostRender,
    RenderedFile,
    RenderedUnit,
    RenderError,
    add_credential,
    templates,
    unit_name,
    watch_unit_name,
)
from hgxserve.render.watch import render_watch
from hgxserve.runtime.fabric import FABRIC_RUN_ARGS, INFINIBAND_DEVICES, fabric_reasons
from hgxserve.topology.model import Engine, SecretRef, Topology
from hgxserve.topology.placement import check_marker_args, serving_mounts, serving_tree
from hgxserve.topology.ports import engine_url, kv_crosses_hosts
from hgxserve.topology.wiring import ENGINE_KEY_VAR, credential_for, engine_secret_env

__all__ = [
    "CredentialSpec",
    "HostRender",
    "RenderError",
    "RenderedFile",
    "RenderedUnit",
    "credential_for",
    "render_host",
    "render_topology",
    "unit_name",
]

MKDIR = "/usr/bin/mkdir"
INSTALL = "/usr/bin/install"
GPU_WAIT_TIMEOUT_S = 120


def render_topology(topo: Topology) -> dict[str, HostRender]:
    """Render every host the topology uses, in the topology's host order."""
    return {host: render_host(topo, host) for host in topo.hosts_in_use()}


def render_host(topo: Topology, host: str) -> HostRender:
    """Render one host: its engine units, then the proxy unit and config when it runs there,
    and its firewall (hgxserve.render.firewall)."""
    try:
        return _render_host(topo, host)
    except UnitValueError as exc:
        # the loader refuses control characters; this is the last line, for values built here
        raise RenderError(f"host {host}: {exc}") from None


def _render_host(topo: Topology, host: str) -> HostRender:
    if host not in topo.hosts:
        known = ", ".join(topo.hosts)
        raise RenderError(f"host {host!r} is not in topology {topo.name} (hosts: {known})")
    units: list[RenderedUnit] = []
    files: dict[str, RenderedFile] = {}
    creds: dict[str, CredentialSpec] = {}
    for engine in topo.engines_on(host):
        unit = _engine_unit(topo, engine, host, creds)
        units.append(unit)
        files[unit.path] = RenderedFile(unit.content)
    for engine in topo.engines_on(host):
        if engine.is_multi_node:
            # after every engine unit: a switch starts the watchers once the engines serve
            unit, watch_files = render_watch(topo, engine, host)
            units.append(unit)
            files.update(watch_files)
    if topo.proxy is not None and topo.proxy.host == host:
        unit, proxy_files = render_proxy(topo, creds)
        units.append(unit)
        files[unit.path] = RenderedFile(unit.content)
        files.update(proxy_files)
    firewall = render_firewall(topo, host)
    if firewall is not None:
        files[paths.FIREWALL_FILE] = RenderedFile(firewall)
    return HostRender(host, units, files, sorted(creds.values(), key=lambda c: c.name))


# --------------------------------------------------------------------------------------------
# engine units
# --------------------------------------------------------------------------------------------


def run_dir(engine: Engine) -> str:
    return f"{paths.RUN_ROOT}/{engine.name}"


def engine_env(topo: Topology, engine: Engine, plan: NodePlan, key: str) -> dict[str, str]:
    """The unit environment of one engine node, in a fixed order; topology env last."""
    env: dict[str, str] = {}
    container = engine.runtime is not None and engine.runtime.is_container
    if not container:
        # In a container the CDI devices are the only GPUs, numbered from 0.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in plan.gpus)
    if engine.engine == "vllm" and engine.internal_port is not None:
        env["VLLM_PORT"] = str(engine.internal_port)
    env.update(_kv_env(engine, plan))
    if _kv_proto_info(topo, engine):
        env["UCX_PROTO_INFO"] = "y"
    pinned = cache_env(topo.cache.root, key)
    for var in ENV_SUBDIRS:
        if var == "SGLANG_DG_CACHE_DIR" and engine.engine != "sglang":
            continue
        env[var] = pinned[var]
    env.update(_run_env(engine))
    for name, value in engine.env.items():
        env[name] = value
    return env


def _kv_env(engine: Engine, plan: NodePlan) -> dict[str, str]:
    """The NIXL side channel and the UCX transports of an engine's KV transfer."""
    env: dict[str, str] = {}
    kv = engine.kv
    if kv is None:
        return env
    if engine.engine == "vllm" and kv.connector == "nixl":
        assert plan.side_channel_host is not None
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = plan.side_channel_host
        # vLLM adds the DP rank itself (base_scheduler.py: + data_parallel_index)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(kv.side_channel_port)
    if kv.ucx_devices is not None:
        devices = kv.ucx_devices
        env["UCX_NET_DEVICES"] = devices if isinstance(devices, str) else ",".join(devices)
    if kv.ucx_tls:
        env["UCX_TLS"] = ",".join(kv.ucx_tls)
    return env


def _kv_proto_info(topo: Topology, engine: Engine) -> bool:
    """NIXL KV to another host: UCX logs the transport each KV endpoint selected
    (`UCX_PROTO_INFO=y`: one table per endpoint configuration and operation, printed once),
    the gate's evidence that KV went over RDMA (hgxserve.release.kvpath). Set whatever
    `gate.rdma` says, so that turning the check on or off restarts no engine."""
    kv = engine.kv
    return kv is not None and kv.connector == "nixl" and kv_crosses_hosts(topo, engine)


def _run_env(engine: Engine) -> dict[str, str]:
    """Where the engine keeps its run files (under its run directory), and the switches
    hgxserve always sets: offline hosts, SGLang's /health without generation."""
    rundir = run_dir(engine)
    env = {"TMPDIR": f"{rundir}/tmp"}
    if engine.engine == "vllm":
        env["VLLM_RPC_BASE_PATH"] = f"{rundir}/rpc"
    env["XDG_CACHE_HOME"] = f"{rundir}/cache"
    env["HF_HOME"] = f"{rundir}/hf"
    env["HF_HUB_OFFLINE"] = "1"
    if engine.engine == "sglang":
        # /health must not generate: probes would pollute load tests (seed 003 §12.4)
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
    return env


def secret_wrapper(
    secret_env: dict[str, SecretRef], unit: str, creds: dict[str, CredentialSpec]
) -> tuple[list[str], list[str]]:
    """LoadCredential= lines and the argv prefix that exports each secret from
    $CREDENTIALS_DIRECTORY, so no secret value is in the unit or on a command line."""
    lines: list[str] = []
    prefix: list[str] = []
    for var, ref in sorted(secret_env.items()):
        name, line, path = credential_for(var, ref)
        add_credential(creds, unit, name, ref, path)
        lines.append(path_value(line))
        prefix.append(f"{var}={name}")
    if prefix:
        prefix = [AGENT, "gpus", "exec-with-credentials", *prefix, "--"]
    return lines, prefix


def engine_warmup(topo: Topology, engine: Engine) -> list[Shape]:
    """The warm-up an engine gets before the proxy admits it: the topology's shapes plus one
    near its max_model_len (seed 003 §8.2); none for SGLang's disaggregated engines, which only
    serve requests paired through a bootstrap room."""
    if not topo.warmup or (engine.engine == "sglang" and engine.role in ("prefill", "decode")):
        return []
    shapes = [Shape(w.input, w.output, w.concurrency, w.api) for w in topo.warmup]
    return warmup_plan(shapes, engine.args.get("max_model_len"))


@dataclass
class _Exec:
    """The Exec*= lines of an engine unit, built up as the runtime asks."""

    start_pre: list[str]
    stop: list[str] = field(default_factory=list)
    stop_post: list[str] = field(default_factory=list)


def _engine_unit(
    topo: Topology, engine: Engine, host: str, creds: dict[str, CredentialSpec]
) -> RenderedUnit:
    if engine.runtime is None:
        raise RenderError(f"engine {engine.name}: no runtime (set runtime.venv or runtime.image)")
    plan = node_plan(topo, engine, host)
    name = unit_name(engine.name)
    weights_tree, _ = serving_tree(topo.model)
    key = cache_key(topo, engine)
    env = engine_env(topo, engine, plan, key)
    gpus = ",".join(str(g) for g in plan.gpus)
    rundir = run_dir(engine)
    key_dir = f"{topo.cache.root}/{key}"
    pre_dirs = sorted({env[v] for v in ENV_SUBDIRS if v in env})
    pre_dirs += [f"{rundir}/{d}" for d in ("tmp", "rpc", "cache", "hf")]
    user = None if engine.runtime.is_container else ENGINE_USER
    directories, make_dirs = _make_dirs(user, [key_dir, rundir], pre_dirs)
    execs = _Exec(make_dirs)
    secrets = engine_secret_env(topo, engine)
    credential_lines, wrapper = secret_wrapper(secrets, name, creds)
    shipped = {f.host_path: f for f in topo.files.values()}
    used_files = sorted({p for _, _, p in engine.host_paths() if p in shipped})
    command = [*engine_program(engine), *engine_args(topo, engine, plan)]
    if engine.engine == "sglang" and ENGINE_KEY_VAR in secrets:
        command = _keyed_sglang(engine, command, plan)
    if engine.runtime.is_container:
        options = _volumes(topo, [key_dir, rundir], used_files)
        options += _container_fabric(topo, engine, plan)
        argv = _container_argv(engine, plan, [*env, *sorted(secrets)], command, options)
        _container_execs(engine, execs)
    else:
        argv = command
    execs.start_pre.append(
        exec_line([AGENT, "weights", "check-marker", *check_marker_args(topo.model)])
    )
    if used_files:
        # the files the runtime stage shipped, as the topology pins them
        checks = [f"{path}={shipped[path].sha256}" for path in used_files]
        execs.start_pre.append(exec_line([AGENT, "runtime", "check-files", *checks]))
    # `+`: the GPUs' process list must hold every user's processes (docs/render.md)
    execs.start_pre.append(_as_root(user, [AGENT, "gpus", "check-free", "--gpus", gpus]))
    execs.stop_post.append(
        _as_root(
            user,
            [AGENT, "gpus", "wait-free", "--gpus", gpus, "--timeout", str(GPU_WAIT_TIMEOUT_S)],
        )
    )
    exec_start_post = [_wait_ready(topo, engine, host, plan, user)] if plan.is_head else []
    if engine.dp > 1 and engine.kv is not None and "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
        base = engine.kv.side_channel_port
        ranks = engine.dp_ranks_on(host)
        plan.notes.append(
            f"NIXL side channel ports {base + ranks.start}-{base + ranks.stop - 1} on this host: "
            f"base {base} + DP rank, added by vLLM"
        )
    plan.notes.append(f"cache key {key}")
    content = (
        templates()
        .get_template("engine.service.j2")
        .render(
            topology=topo.name,
            headline=_headline(engine, plan),
            notes=plan.notes,
            description=_description(engine, plan, gpus),
            mounts=[mount_unit_name(m) for m in serving_mounts(topo.model)],
            environment=[environment_value(k, v) for k, v in env.items()],
            credentials=credential_lines,
            exec_start_pre=execs.start_pre,
            exec_start=exec_line([*wrapper, *argv]),
            exec_start_post=exec_start_post,
            start_timeout_s=engine.start_timeout_s,
            restart=not engine.is_multi_node,
            watch_unit=watch_unit_name(engine.name),
            exec_stop=execs.stop,
            exec_stop_post=execs.stop_post,
            user=user,
            directories=directories,
            # venv engines: nothing of the host writable but what the engine needs (root's
            # /opt/hgxserve, which the unit's `+` lines run, out of its reach); podman (root)
            # writes its own state under /var/lib/containers and /run
            protect_system="strict" if user else "full",
            read_only_paths=path_list([weights_tree], optional=True),
            read_write_paths=path_list(
                [key_dir, rundir, *([paths.ENGINE_HOME] if user else [])], optional=True
            ),
        )
    )
    return RenderedUnit(
        name=name,
        engine=engine.name,
        role=engine.role,
        argv=argv,
        env=env,
        gpus=plan.gpus,
        content=content,
        node_rank=plan.node_rank,
        nnodes=plan.nnodes,
        secret_env={var: credential_for(var, ref)[1] for var, ref in secrets.items()},
    )


def _wait_ready(
    topo: Topology, engine: Engine, host: str, plan: NodePlan, user: str | None
) -> UnitText:
    """The head's ExecStartPost=: wait until the engine serves, warm it up."""
    secrets = engine_secret_env(topo, engine)
    # The unit stays `activating` until the engine serves, so TimeoutStartSec= bounds the
    # whole start (weights, compile, CUDA graphs), not only the fork of the main process.
    health = engine_url(topo, engine, from_host=host) + "/health"
    wait = [AGENT, "release", "wait-ready", health, "--timeout", str(engine.start_timeout_s)]
    shapes = engine_warmup(topo, engine)
    if shapes:
        # sent to the engine itself before the unit is active, and the proxy only starts
        # once every engine of the release is: no user request meets a cold shape
        wait += ["--warmup", shapes_arg(shapes)]
        if ENGINE_KEY_VAR in secrets:
            # A keyed engine answers 401 without its key. The warm-up reads it from the
            # same credential source as the engine (named here, never its value): systemd
            # 252 does not give ExecStartPost= the unit's credentials once the unit has a
            # mount namespace (ProtectSystem=, PrivateTmp=), so no $CREDENTIALS_DIRECTORY.
            _, source, _ = credential_for(ENGINE_KEY_VAR, secrets[ENGINE_KEY_VAR])
            wait += ["--api-key-credential", source]
    elif topo.warmup:
        plan.notes.append(
            "no warm-up before admission: SGLang prefill/decode serve only P/D-paired requests"
        )
    # `+` when it reads the key: its source is root's (0600 in a 0700 directory)
    keyed = "--api-key-credential" in wait
    return _as_root(user, wait) if keyed else exec_line(wait)


def systemd_directory(path: str) -> tuple[str, str] | None:
    """(directive, path relative to its root) of a directory systemd makes for the unit's
    user itself (`CacheDirectory=` under /var/cache, `StateDirectory=` under /var/lib), None
    for a path elsewhere.

    >>> systemd_directory("/var/cache/hgxserve/k1")
    ('CacheDirectory', 'hgxserve/k1')
    >>> systemd_directory("/srv/cache/k1") is None
    True
    """
    norm = posixpath.normpath(path)
    for directive, root in (("CacheDirectory", "/var/cache"), ("StateDirectory", "/var/lib")):
        if norm.startswith(root + "/"):
            return directive, norm[len(root) + 1 :]
    return None


def _make_dirs(
    user: str | None, tops: list[str], dirs: list[str]
) -> tuple[list[UnitText], list[str]]:
    """The unit lines that make the engine's key and run directories (`tops`) and the cache
    and run directories inside them (`dirs`): (directives of [Service], ExecStartPre= lines).

    For an engine that runs as `user`, root never acts inside a directory the user can write
    (GNU `install -d`, as root, follows a link the user planted there and hands its target
    over): systemd makes each top under root's /var/cache or /var/lib for the user
    (`CacheDirectory=`, `StateDirectory=`; systemd creates it in its root-owned parent and
    changes the owner of what is inside without following links); a top elsewhere (a
    `cache.root` outside those) is made by `+install -d` in its parent, which is root's; the
    directories inside are made by the user (`mkdir -p` without `+`). A container engine's
    unit runs as root: `mkdir -p`."""
    if user is None:
        return [], [exec_line([MKDIR, "-p", *dirs])]
    by_directive: dict[str, list[str]] = {}
    elsewhere: list[str] = []
    for top in tops:
        found = systemd_directory(top)
        if found is None:
            elsewhere.append(top)
        else:
            by_directive.setdefault(found[0], []).append(found[1])
    directives: list[UnitText] = []
    for directive in ("CacheDirectory", "StateDirectory"):
        if directive in by_directive:
            directives.append(UnitText(f"{directive}={path_list(by_directive[directive])}"))
            directives.append(UnitText(f"{directive}Mode=0750"))
    lines: list[str] = []
    if elsewhere:
        owned = [INSTALL, "-d", "-o", user, "-g", user, "-m", "0750", *elsewhere]
        lines.append(UnitText("+" + exec_line(owned)))
    lines.append(exec_line([MKDIR, "-p", *dirs]))
    return directives, lines


def _keyed_sglang(engine: Engine, command: list[str], plan: NodePlan) -> list[str]:
    """A keyed SGLang engine's command: its own Python runs the key launcher
    (hgxserve.base.enginekey), which hands SGLang `--api-key` in memory."""
    runtime = engine.runtime
    assert runtime is not None
    python = f"{runtime.venv.rstrip('/')}/bin/python" if runtime.venv else "python3"
    plan.notes.append(
        f"SGLang takes its key only as --api-key: {python} adds it from {ENGINE_KEY_VAR} in "
        "memory, so it is on no command line"
    )
    return keyed_sglang_command(python, command)


def _as_root(user: str | None, argv: list[str]) -> UnitText:
    """An Exec*= line that runs with full privileges (`+`) in a unit with User=; as written in
    one without (container engines: their podman runs as root)."""
    line = exec_line(argv)
    return UnitText("+" + line) if user else line


def _volumes(topo: Topology, writable: list[str], read_only: list[str]) -> list[str]:
    """The container's --volume options: the weights read-only, then `writable`, then
    `read_only`."""
    weights_tree, _ = serving_tree(topo.model)
    volumes = [
        f"{weights_tree}:{weights_tree}:ro",
        *(f"{path}:{path}" for path in writable),
        *(f"{path}:{path}:ro" for path in read_only),
    ]
    return [word for volume in volumes for word in ("--volume", volume)]


def _container_tool(engine: Engine) -> tuple[str, str, str]:
    """(tool name, its path, the container's name) of a container engine."""
    runtime = engine.runtime
    assert runtime is not None
    tool_name = runtime.tool or "podman"
    return tool_name, CONTAINER_TOOLS[tool_name], f"hgxserve-{engine.name}"


def _container_fabric(topo: Topology, engine: Engine, plan: NodePlan) -> list[str]:
    """The host's HCAs for a container engine that moves KV or collectives over RDMA
    (hgxserve.runtime.fabric); --ipc host and memlock, which every container engine gets, give
    it the host's /dev/shm (the host's `shm` setting) and unlimited pinned memory."""
    reasons = fabric_reasons(topo, engine, plan.host)
    if reasons:
        plan.notes.append(
            f"RDMA in the container (--device {INFINIBAND_DEVICES}, --cap-add IPC_LOCK; "
            f"--ipc host and memlock as every container): {'; '.join(reasons)}"
        )
        return list(FABRIC_RUN_ARGS)
    if kv_crosses_hosts(topo, engine) and not topo.hosts[plan.host].rdma:
        plan.notes.append(
            f"no RDMA devices in the container: host {plan.host} lists no rdma, so its "
            "traffic to other hosts (NCCL, KV) goes over TCP"
        )
    return []


def _container_argv(
    engine: Engine, plan: NodePlan, env_names: list[str], command: list[str], options: list[str]
) -> list[str]:
    """`podman|docker run` of the engine's image with CDI GPUs; `options` are the run options
    after the GPUs (volumes, the fabric's devices). `env_names` go in by name: the unit's
    environment, then its secrets (the engine's secret_env and the engines' key, which the
    wrapper exports to the tool)."""
    runtime = engine.runtime
    assert runtime is not None
    tool_name, tool, container = _container_tool(engine)
    argv = [
        tool,
        "run",
        # the runtime stage loaded the image by digest; a switch never waits on a pull
        "--pull=never",
        "--rm",
        "--name",
        container,
        "--network",
        "host",
        "--ipc",
        "host",
        "--ulimit",
        "memlock=-1:-1",
    ]
    for gpu in plan.gpus:
        argv += ["--device", f"nvidia.com/gpu={gpu}"]
    argv += options
    for var in dict.fromkeys(env_names):
        # --env NAME passes the value from the unit's environment, never on the command line
        argv += ["--env", var]
    argv += ["--entrypoint", command[0], str(runtime.image), *command[1:]]
    gpus = ",".join(str(g) for g in plan.gpus)
    plan.notes.append(f"container {runtime.image} with CDI GPUs {gpus} via {tool_name}")
    return argv


def _container_execs(engine: Engine, execs: _Exec) -> None:
    """The container is removed before the start and after the stop."""
    tool_name, tool, container = _container_tool(engine)
    remove = (
        [tool, "rm", "--force", "--ignore", container]
        if tool_name == "podman"
        else [tool, "rm", "--force", container]
    )
    execs.start_pre.append(UnitText("-" + exec_line(remove)))
    execs.stop.append(exec_line([tool, "stop", "--time", "60", container]))
    execs.stop_post.append(UnitText("-" + exec_line(remove)))


def _description(engine: Engine, plan: NodePlan, gpus: str) -> str:
    where = f"GPUs {gpus}"
    if plan.nnodes > 1:
        where += f", node {plan.node_rank}/{plan.nnodes}"
    return (
        f"hgxserve {engine.role} engine {engine.name} "
        f"({engine.engine} {engine.version or ''}".rstrip()
        + f", {where})"
    )


def _headline(engine: Engine, plan: NodePlan) -> str:
    headline = f"{engine.engine} {engine.version or '(version not pinned)'} {engine.role} engine "
    headline += engine.name
    if plan.nnodes > 1:
        kind = "head" if plan.is_head else "worker"
        headline += f", node {plan.node_rank} of {plan.nnodes} ({kind})"
    return headline
