"""One plan per stage: what a deploy file (deploys/<stage>.py) hands its roles on one host.

Each `<stage>_plan(host, ...)` loads the topology `--data topology=FILE` names, reads the stage's
`--data` keys through the typed table (`hgxserve.deploy.data`) and returns a frozen plan object;
anything wrong is a DeployError with a message for the operator, raised before a role runs.
The deploy files hand the plans (or the part of one a role runs) to the roles whole: a role
reads its fields, so a deploy file stays a list of role calls. The defaults of a plan's fields
are the role's own, for a role called with the fields as keywords instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pyinfra import logger
from pyinfra.api import DeployError
from pyinfra.api.host import Host
from pyinfra.api.inventory import Inventory

from hgxserve.base.cachelayout import DEFAULT_ROOT as CACHE_ROOT
from hgxserve.base.defaults import S3_REQUEST_DEADLINE_S, SWITCH_OVERHEAD_S
from hgxserve.base.paths import AGENT
from hgxserve.base.runstate import per_run
from hgxserve.bench.releasegate import BenchStep, bench_step_for
from hgxserve.deploy.bakers import cache_entries, elect_bakers
from hgxserve.deploy.data import DeployData, deploy_data
from hgxserve.deploy.keyfiles import check_env_keys, check_host_key_files
from hgxserve.deploy.stages import in_site_run, record_site_stages
from hgxserve.deploy.switching import (
    env_secret_values,
    plan_switch,
    release_plans,
    require_all_reachable,
    rollback_targets,
    secret_values,
)
from hgxserve.facts.preflight import HostExpectation, expectation_from_topology
from hgxserve.facts.release import ReleaseState
from hgxserve.facts.runtime import HostPython
from hgxserve.monitoring.host_files import HostMonitoring, host_monitoring
from hgxserve.release import CONFIRM_WITHIN_S
from hgxserve.release.coordination import Coordination, RunPlan
from hgxserve.release.fabric import FabricRun, fabric_scope
from hgxserve.release.plan import HostRelease, gate_host, switch_bound_s
from hgxserve.release.store import UnitSpec
from hgxserve.release.switch import start_timeout
from hgxserve.render import render_host
from hgxserve.runtime.files import FileSourceError, local_copy
from hgxserve.runtime.images import archive_name, image_digest
from hgxserve.runtime.indexlock import IndexLock, IndexLockError, read_index_lock
from hgxserve.runtime.spec import RuntimeSpecError, VenvRuntime, container_images, venv_runtimes
from hgxserve.runtime.wheelhouse import (
    HostPlatform,
    IndexOptions,
    WheelhouseError,
    build_wheelhouse,
)
from hgxserve.topology import Topology, TopologyError, load_topology
from hgxserve.topology.kernels import deepep_across_hosts
from hgxserve.topology.model import Host as TopologyHost
from hgxserve.topology.model import Model, S3Source, TopologyFile
from hgxserve.topology.placement import pin_digest
from hgxserve.topology.trust import (
    TrustError,
    TrustRoot,
    env_refusals,
    load_pins,
    pinned,
    trust_root,
    unpinned_refusal,
)
from hgxserve.weights.published import published_manifest_size

Plan = TypeVar("Plan")


def plan_or_fields(plan: Plan | None, kind: type[Plan], fields: dict[str, Any]) -> Plan:
    """A role's plan: the one it was given, or one of `kind` from the fields it was given as
    keywords instead (a TypeError for both, or for a field `kind` does not have)."""
    if plan is None:
        return kind(**fields)
    if fields:
        raise TypeError(f"give a plan or its fields, not both ({', '.join(sorted(fields))})")
    return plan


# --- the topology and this host's part of it -------------------------------------------------


def stage_topology(host: Host) -> Topology:
    """The validated topology `--data topology=FILE` (or $HGXSERVE_TOPOLOGY) names, with its
    weights pinned as the inventory says (`trusted_topology`)."""
    data = deploy_data(host)
    path = data.get("topology")
    if not path:
        raise DeployError("no topology given: pass --data topology=topologies/<name>.yml")
    try:
        topology = load_topology(path)
    except TopologyError as exc:
        raise DeployError(f"invalid topology {path}:\n{exc}") from None
    return trusted_topology(topology, data, host)


def trusted_topology(topology: Topology, data: DeployData, host: Host | None = None) -> Topology:
    """`topology` with `model.digest` set from the inventory's pins file (`model_pins`); a
    DeployError, before anything runs, for an `{env: VAR}` secret whose VAR the inventory does
    not allow (`allow_env`), a pin that contradicts `model.digest`, or trust_remote_code on
    weights nothing but the bucket vouches for."""
    refused = env_refusals(topology, data.get("allow_env"))
    if refused:
        raise DeployError("\n".join(refused))
    pins_file = data.get("model_pins")
    try:
        root = trust_root(topology.model, load_pins(pins_file) if pins_file else {}, pins_file)
    except TrustError as exc:
        raise DeployError(str(exc)) from None
    if data.given("weights_digest"):  # this run's explicit pin (--data weights_digest=)
        root = TrustRoot(data.get("weights_digest"), "data")
    refusal = unpinned_refusal(topology, root)
    if refusal:
        raise DeployError(refusal)
    if root.digest is None and host is not None:
        per_run(host.state, ("unpinned-weights", topology.model.name), lambda: logger.warning(
            f"weights of {topology.model.name}: {root.text()}; whoever can write the bucket "
            "chooses them (pin them: model.digest, or the inventory's model_pins)"
        ))  # fmt: skip
    return pinned(topology, root)


def topology_host(host: Host) -> tuple[Topology, TopologyHost]:
    """The topology and `host`'s entry in it; a DeployError for a host the topology lacks."""
    topology = stage_topology(host)
    if host.name not in topology.hosts:
        raise DeployError(
            f"{host.name}: not a host of topology {topology.name} "
            f"(hosts: {', '.join(sorted(topology.hosts))})"
        )
    return topology, topology.hosts[host.name]


def _venv_runtimes(topology: Topology, host: Host, require_version: bool) -> list[VenvRuntime]:
    try:
        return venv_runtimes(topology, host.name, require_version=require_version)
    except RuntimeSpecError as exc:
        detail = str(exc).replace("\n", "\n  ")
        raise DeployError(f"runtime: topology {topology.name}:\n  {detail}") from None


def _planned_driver(host: Host, data: DeployData) -> str | None:
    """The driver a provision stage of this site run installs (None outside such a run)."""
    return str(data.get("driver_version")) if in_site_run(host, "provision") else None


# --- site -------------------------------------------------------------------------------------


def site_stages(host: Host) -> tuple[str, ...]:
    """The stages deploys/site.py runs (`--data stages=`), noted for this run so that each
    stage's checks leave out what a later stage installs."""
    return record_site_stages(host, deploy_data(host).get("stages"))


# --- preflight and provision ------------------------------------------------------------------


@dataclass(frozen=True)
class PreflightPlan:
    expect: HostExpectation
    after_provision: bool = True  # `--data preflight=full`: the provisioned state and runtimes too
    runtimes: tuple[VenvRuntime, ...] = ()
    runtime_installs: bool = False  # the runtime stage of this site run installs missing runtimes
    images: tuple[tuple[str, str], ...] = ()  # (image, tool) container runtimes that must be loaded
    planned_driver: str | None = None  # the driver a provision stage of this run installs


def host_expectation(topology: Topology, host: Host) -> HostExpectation:
    """What the topology asks of `host`; without `model.size`, the model's size is its published
    manifest's total (S3 sources, read on the controller), or the role reads the manifest already
    on the host (roles/preflight.py)."""
    expect = expectation_from_topology(topology, host.name)
    source = topology.model.source
    if expect.model_size_bytes or not isinstance(source, S3Source):
        return expect
    kind, ref = source.credentials or ("chain", "")
    size, where = published_manifest_size(
        f"{source.url.rstrip('/')}/{topology.model.manifest}",
        source.endpoint,
        source.region,
        source.addressing,
        ref if kind == "profile" else None,
    )
    return replace(expect, model_size_bytes=size, model_size_from=where)


def preflight_plan(host: Host) -> PreflightPlan:
    topology, _ = topology_host(host)
    data = deploy_data(host)
    full = data.get("preflight") == "full"
    runtimes = _venv_runtimes(topology, host, require_version=False) if full else []
    images = container_images(topology, host.name)
    return PreflightPlan(
        expect=host_expectation(topology, host),
        after_provision=full,
        runtimes=tuple(runtimes),
        runtime_installs=in_site_run(host, "runtime"),
        images=tuple(images) if full else (),
        planned_driver=_planned_driver(host, data),
    )


@dataclass(frozen=True)
class ProvisionPlan:
    preflight: PreflightPlan  # the hardware only: nothing changes on a host with the wrong GPUs
    driver_version: str
    driver_branch: str
    apt_source: str | None
    fabric_manager: bool  # `--data fabric_manager=never`: not installed
    require_nvswitch: bool  # `auto`: only where NVSwitch is present
    rdma: bool  # the host has RDMA devices: packages, peermem
    load_now: bool
    remount_shm: bool
    shm: int | None  # the topology's /dev/shm size (None: the role's default)
    ibgda: bool = False  # an engine here runs DeepEP across hosts: the nvidia IBGDA options


def provision_plan(host: Host) -> ProvisionPlan:
    topology, spec = topology_host(host)
    data = deploy_data(host)
    version = str(data.get("driver_version"))
    fm_mode = data.get("fabric_manager")
    return ProvisionPlan(
        preflight=PreflightPlan(host_expectation(topology, host), after_provision=False),
        driver_version=version,
        driver_branch=version.split(".")[0],
        apt_source=data.get("apt_source"),
        fabric_manager=fm_mode != "never",
        require_nvswitch=fm_mode != "always",
        rdma=bool(spec.rdma),
        load_now=data.get("load_now"),
        remount_shm=data.get("remount_shm"),
        shm=spec.shm,
        ibgda=bool(deepep_across_hosts(topology, host.name)),
    )


# --- runtime ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VenvPlan:
    spec: VenvRuntime
    wheelhouse: Callable[[], tuple[Path, str]]  # built on the controller when the role needs it
    index_url: str | None  # `runtime_source=index`: the hosts install from this mirror
    planned_driver: str | None  # the driver a provision stage of this run installs
    s3: WheelS3 | None = None  # where `runtime.wheels` with an s3:// url come from
    index_lock: IndexLock | None = None  # with index_url: the lab's hash lock (else unpinned)


@dataclass(frozen=True)
class WheelS3:
    """The S3 the agent fetches `runtime.wheels` urls from: the weights' (as image archives)."""

    env_file: str | None = None
    endpoint: str | None = None
    addressing: str = "auto"


def _wheel_s3(topology: Topology) -> WheelS3:
    weights_s3 = topology.model.source if isinstance(topology.model.source, S3Source) else None
    if weights_s3 is None:
        return WheelS3()
    creds = weights_s3.credentials
    return WheelS3(
        env_file=creds[1] if creds and creds[0] == "env_file" else None,
        endpoint=weights_s3.endpoint,
        addressing=weights_s3.addressing,
    )


@dataclass(frozen=True)
class ImagePlan:
    image: str  # repo@sha256:<64 hex>, as the topology pins it
    tool: str = "podman"
    mirror: str | None = None  # a registry mirror (host[:port]) the image is pulled through
    archive_url: str | None = None  # s3:// URL of an OCI archive of the image
    s3_env_file: str | None = None  # with s3_endpoint and s3_addressing: that S3
    s3_endpoint: str | None = None
    s3_addressing: str = "auto"


@dataclass(frozen=True)
class RuntimePlan:
    venvs: tuple[VenvPlan, ...]
    images: tuple[ImagePlan, ...]
    agent: bool  # image archives / `runtime.wheels` urls are fetched and checked by the agent
    files: tuple[tuple[TopologyFile, Path], ...]


def _wheelhouse(
    requirements: tuple[str, ...], platform: HostPlatform, index: IndexOptions
) -> tuple[Path, str]:
    try:
        return build_wheelhouse(requirements, platform, index)
    except WheelhouseError as exc:
        raise DeployError(f"runtime wheelhouse: {exc}") from None


def _index(data: DeployData) -> tuple[IndexOptions, str | None]:
    """Where the controller's wheels come from, and the index the hosts use themselves."""
    source = data.get("runtime_source")
    index_url = data.get("runtime_index_url")
    if source == "index" and not index_url:
        raise DeployError("runtime_source=index needs runtime_index_url (a mirror the hosts reach)")
    options = IndexOptions(
        index_url=index_url,
        find_links=data.get("runtime_find_links"),
        no_index=data.get("runtime_no_index"),
    )
    return options, index_url if source == "index" else None


def _index_lock(data: DeployData, index_url: str | None) -> IndexLock | None:
    """The lab's hash lock for `runtime_source=index`: required, unless the run says
    `runtime_index_unpinned=true` (then every run prints that the mirror is trusted as is)."""
    path = data.get("runtime_index_lock")
    if index_url is None:
        return None
    if path is None:
        if not data.get("runtime_index_unpinned"):
            raise DeployError(
                "runtime_source=index needs runtime_index_lock=PATH (a requirements file pinning "
                "every package by version and --hash=sha256:, e.g. from `pip-compile "
                "--generate-hashes` against the mirror), or runtime_index_unpinned=true to "
                f"install from {index_url} without one"
            )
        logger.warning(
            f"runtime: installing from {index_url} WITHOUT a hash lock "
            "(runtime_index_unpinned=true): the mirror's files are trusted as they are"
        )
        return None
    try:
        return read_index_lock(path)
    except IndexLockError as exc:
        raise DeployError(f"runtime_index_lock: {exc}") from None


def _check_lock_covers(lock: IndexLock | None, specs: list[VenvRuntime]) -> None:
    if lock is None:
        return
    for spec in specs:
        missing = lock.uncovered(spec.requirements)
        if missing:
            raise DeployError(
                f"runtime_index_lock {lock.path}: the venv {spec.venv} needs {', '.join(missing)}"
            )


def _venvs(
    host: Host,
    specs: list[VenvRuntime],
    index: IndexOptions,
    index_url: str | None,
    driver: str | None,
) -> tuple[VenvPlan, ...]:
    if not specs:
        return ()
    python = host.get_fact(HostPython)
    if not python.get("version"):
        raise DeployError(f"{host.name}: runtime: the host has no python3 to create a venv with")
    platform = HostPlatform(python["version"], python["machine"], python["glibc"])
    return tuple(
        VenvPlan(spec, partial(_wheelhouse, spec.requirements, platform, index), index_url, driver)
        for spec in specs
    )


def _images(topology: Topology, host: Host, data: DeployData) -> tuple[ImagePlan, ...]:
    prefix = data.get("image_archive_prefix")
    # archives come from the same S3 as the weights unless told otherwise
    weights_s3 = topology.model.source if isinstance(topology.model.source, S3Source) else None
    creds = weights_s3.credentials if weights_s3 else None
    env_file = creds[1] if creds and creds[0] == "env_file" else None
    return tuple(
        ImagePlan(
            image=image,
            tool=tool,
            mirror=data.get("image_mirror"),
            archive_url=f"{prefix.rstrip('/')}/{archive_name(image_digest(image))}"
            if prefix
            else None,
            s3_env_file=data.get("image_s3_env_file") or env_file,
            s3_endpoint=data.get("image_s3_endpoint")
            or (weights_s3.endpoint if weights_s3 else None),
            s3_addressing=data.get("image_s3_addressing")
            or (weights_s3.addressing if weights_s3 else "auto"),
        )
        for image, tool in container_images(topology, host.name)
    )


def _files(topology: Topology, host: Host) -> tuple[tuple[TopologyFile, Path], ...]:
    """The topology's `files:`, copied on the controller, for a host that runs an engine."""
    if not (topology.files and topology.engines_on(host.name)):
        return ()
    try:
        return tuple((spec, local_copy(spec)) for spec in topology.files.values())
    except FileSourceError as exc:
        raise DeployError(f"runtime: {exc}") from None


def runtime_plan(host: Host) -> RuntimePlan:
    topology, _ = topology_host(host)
    data = deploy_data(host)
    specs = _venv_runtimes(topology, host, require_version=True)
    index, host_index_url = _index(data)
    lock = _index_lock(data, host_index_url) if specs else None
    _check_lock_covers(lock, specs)
    images = _images(topology, host, data)
    driver = _planned_driver(host, data)
    return RuntimePlan(
        venvs=tuple(
            replace(v, s3=_wheel_s3(topology), index_lock=lock)
            for v in _venvs(host, specs, index, host_index_url, driver)
        ),
        images=images,
        agent=(bool(images) and data.given("image_archive_prefix"))
        or any(w.url for s in specs for w in s.wheels),
        files=_files(topology, host),
    )


# --- weights and caches -----------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsPlan:
    model: Model
    digest: str | None = None  # `--data weights_digest=` over the topology's `model.digest`
    agent: str = AGENT
    request_deadline_s: float = S3_REQUEST_DEADLINE_S  # `--data weights_request_deadline=`


def weights_plan(host: Host) -> WeightsPlan:
    topology, _ = topology_host(host)
    data = deploy_data(host)
    return WeightsPlan(
        model=topology.model,
        digest=data.get("weights_digest") or topology.model.digest,
        agent=data.get("agent"),
        request_deadline_s=data.get("weights_request_deadline"),
    )


@dataclass(frozen=True)
class CachesPlan:
    engines: list[dict[str, Any]]  # one per engine on this host: engine, key, full_key, facts
    topology: str  # the topology file on the controller (uploaded to a baker)
    store: str  # the controller's directory of archives per full key
    policy: str = "auto"
    distribute: str = "controller"
    root: str = CACHE_ROOT  # the cache root on the hosts
    bakers: dict[str, str] = field(default_factory=dict)  # full key -> the host that bakes it
    runs: bool = True  # the cache policy is not `off` and the host runs an engine
    # host path -> value: what a baker's engine units read
    bake_secrets: dict[str, str] = field(default_factory=dict)


def _bake_secrets(topology: Topology, host: Host, bakers: dict[str, str]) -> dict[str, str]:
    """A bake starts the engine with its unit's secrets (a keyed engine's VLLM_API_KEY): the
    credentials from the controller's environment go to the host before it."""
    if host.name not in bakers.values():
        return {}
    check_env_keys(topology)
    rendered = render_host(topology, host.name).credentials
    return env_secret_values({c.path: c.ref for c in rendered if c.path is not None})


def caches_plan(host: Host, inventory: Inventory) -> CachesPlan:
    topology = stage_topology(host)
    data = deploy_data(host)
    runs = topology.cache.policy != "off" and bool(topology.engines_on(host.name))
    bakers = elect_bakers(topology, list(inventory.iter_activated_hosts())) if runs else {}
    return CachesPlan(
        runs=runs,
        bake_secrets=_bake_secrets(topology, host, bakers),
        engines=cache_entries(topology, host) if runs else [],
        topology=str(data.get("topology")),
        store=os.path.expanduser(data.get("cache_store")),
        policy=topology.cache.policy,
        distribute=topology.cache.distribute,
        root=topology.cache.root,
        bakers=bakers,
    )


# --- engines (the release) and rollback -------------------------------------------------------


@dataclass(frozen=True)
class SwitchPlan:
    """A switch of every host together to a staged release, this host's part in it: the
    engines stage's (after staging the release) and the rollback's."""

    release_id: str
    coord: Coordination  # shared by all hosts of the run: its plan, what the hosts report
    switch: bool  # this host's current release differs
    gate: bool  # this host runs the topology's gate after all hosts switched
    confirm_within: int = CONFIRM_WITHIN_S  # seconds the gate has once every host switched
    peers_within: int = 0  # seconds the slowest host may take to switch (switch_bound_s)
    rdma: tuple[str, list[str]] | None = None  # (sysfs root, devices) for the RDMA evidence
    kv_units: tuple[str, ...] = ()  # engine units whose UCX transport is the KV path evidence
    bench: BenchStep | None = None  # the SLA bench after the gate, on the gate's host
    bench_s: int = 0  # seconds the bench may take: the switched hosts' timers wait as long


@dataclass(frozen=True)
class FabricPlan:
    """The fabric preflight (`gate.fabric`), this host's part: the run's shared state, what
    this host reads, serves and measures, and where (every host of the switch takes the
    verdict)."""

    run: FabricRun  # shared by all hosts of the run: scope, readings, measurements
    links: bool  # this host names rails the preflight reads
    serves: bool  # this host runs ib_write_bw servers
    measures: bool  # this host runs ib_write_bw clients
    allreduce: str | None  # mpirun, where this host heads a multi-host engine (`nccl_mpirun`)
    sysfs: str  # where the RDMA ports are read (inventory `rdma_sysfs`)
    addresses: dict[str, str]  # host -> topology address (the servers' out-of-band TCP)


@dataclass(frozen=True)
class EnginesPlan:
    release: HostRelease  # this host's release, staged before the switch
    secret_values: dict[str, str]  # host path -> secret value of the units' credentials
    switching: SwitchPlan
    fabric: FabricPlan | None = None  # the fabric preflight, when this release crosses hosts


def fabric_plan(topology: Topology, host: Host, coord: Coordination) -> FabricPlan | None:
    """This host's part in the fabric preflight: None when no host switches, when the release
    does not cross hosts or names no rails, or with `gate.fabric: off`."""
    scope = fabric_scope(topology) if coord.plan.switching else None
    if scope is None:
        return None
    data = deploy_data(host)
    mpirun = data.get("nccl_mpirun")
    run = per_run(
        host.state,
        ("fabric", topology.digest),
        lambda: FabricRun(scope=scope, policy=topology.gate.fabric),
    )
    return FabricPlan(
        run=run,
        links=bool(scope.rails.get(host.name)),
        serves=bool(scope.servers(host.name)),
        measures=bool(scope.clients(host.name)),
        allreduce=mpirun if any(s.hosts[0] == host.name for s in scope.spans) else None,
        sysfs=data.get("rdma_sysfs"),
        addresses={name: h.address for name, h in topology.hosts.items()},
    )


def _bench(
    topology: Topology, host: Host, active: list[Host], data: DeployData
) -> BenchStep | None:
    """The SLA bench (`gate.bench:`), run on the controller by the gate's host."""
    if topology.gate.bench is None or host.name != gate_host(topology):
        return None
    return bench_step_for(topology, topology.source_file, active, data.get("bench_tokenizer"))


def _counter_devices(topology: Topology, host: str, run: RunPlan) -> list[str]:
    """The RDMA devices whose port counters are the host's counter evidence: the rails that
    carry only KV when the topology tells them (the run's `kv_rails`:
    hgxserve.release.kvpath.kv_only_rails), else the host's `rdma:` devices (none: every
    device)."""
    rails = run.kv_rails.get(host)
    if rails:
        return list(rails)
    return list(topology.hosts[host].rdma) if host in topology.hosts else []


def engines_plan(host: Host, inventory: Inventory) -> EnginesPlan:
    data = deploy_data(host)
    # a pinned weights digest (as for the weights stage) reaches the units
    topology = pin_digest(stage_topology(host), data.get("weights_digest"))
    active = list(inventory.iter_activated_hosts())
    require_all_reachable(list(inventory), active)
    plans = release_plans(topology, active, data.get("health_timeout"))
    targets = {n: p.id for n, p in plans.items()}
    coord = plan_switch(f"release:{topology.digest}", active, targets, topology)
    run, plan = coord.plan, plans[host.name]
    kv_units = sorted({ep.unit for ep in run.kv_endpoints if ep.host == host.name})
    devices = _counter_devices(topology, host.name, run)
    bench = _bench(topology, host, active, data)
    check_env_keys(topology)  # the API keys pushed, and those the units load on this host
    check_host_key_files(topology, host)
    secrets = secret_values(plan)
    switching = SwitchPlan(
        release_id=plan.id,
        coord=coord,
        switch=host.name in run.switching,
        gate=bool(run.switching) and host.name == gate_host(topology),
        confirm_within=data.get("confirm_within"),
        peers_within=switch_bound_s(plans, SWITCH_OVERHEAD_S),
        rdma=(data.get("rdma_sysfs"), devices) if host.name in run.rdma_roles else None,
        kv_units=tuple(kv_units),
        bench=bench,
        bench_s=topology.gate.bench.timeout_s if topology.gate.bench is not None else 0,
    )
    # every host in the run takes part once any host switches: a pair needs both ends
    fabric = fabric_plan(topology, host, coord)
    return EnginesPlan(release=plan, secret_values=secrets, switching=switching, fabric=fabric)


def rollback_plan(host: Host, inventory: Inventory) -> SwitchPlan:
    """The switch back to each host's `previous` (or `baseline`) release, gated again."""
    data = deploy_data(host)
    hosts = list(inventory.iter_activated_hosts())
    require_all_reachable(list(inventory), hosts)
    to = data.get("to")
    targets = rollback_targets(hosts, to)
    coord = plan_switch(f"rollback:{to}", hosts, targets)
    state = host.get_fact(ReleaseState)
    # The staged releases' engine timeouts are on the hosts: bound the slowest by the default one.
    slowest = start_timeout(UnitSpec("engine", "engine"), data.get("health_timeout"))
    return SwitchPlan(
        release_id=targets[host.name],
        coord=coord,
        switch=host.name in coord.plan.switching,
        gate=bool(coord.plan.switching) and bool(state.get(f"gate_{to}")),  # to: previous|baseline
        confirm_within=data.get("confirm_within"),
        peers_within=int(SWITCH_OVERHEAD_S + slowest) + 1,
    )


# --- monitoring -------------------------------------------------------------------------------


def monitoring_plan(host: Host) -> HostMonitoring | None:
    """What `host` runs for the topology's `monitoring:`; None (and a note in the log) for a
    topology without one or a host that is not in use."""
    topology = stage_topology(host)
    part = host_monitoring(topology, host.name, deploy_data(host).get("container_tool"))
    if part is None:
        why = "no monitoring: section" if topology.monitoring is None else "not a host in use"
        logger.info(f"{host.print_prefix}monitoring: nothing to do ({why} in {topology.name})")
    return part
