"""Release role: stage this host's rendered tree as a release, switch to it, and take part in
the topology-wide gate so that all hosts switch together or all go back."""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, python, server, systemd

from hgxserve.base.paths import (
    FIREWALL_CONTROLLER_FILE,
    FIREWALL_FILE,
    FIREWALL_INCLUDE_DIR,
    NFT,
    RELEASE_ROOT,
)
from hgxserve.bench.releasegate import run_bench_gate
from hgxserve.deploy.plans import EnginesPlan, FabricPlan, SwitchPlan
from hgxserve.facts.host import ControllerAddress, HostFirewall
from hgxserve.operations.credentials import secret_file
from hgxserve.operations.fabric import (
    fabric_allreduce,
    fabric_links,
    fabric_measure,
    fabric_serve,
    fabric_verdict,
)
from hgxserve.operations.packages import pinned_packages
from hgxserve.operations.release import (
    arm_deadman,
    check_kv,
    note_moves,
    pause_proxy,
    read_kv_path,
    read_rdma_counters,
    run_gate,
    settle,
    start_proxy,
    switched,
)
from hgxserve.release.coordination import Coordination
from hgxserve.render.firewall import controller_elements

RECONCILE_UNIT = (
    Path(__file__).resolve().parent.parent
    / "hgxserve"
    / "files"
    / "release"
    / "hgxserve-release-reconcile.service"
)


@deploy("Stage and switch the release")
def release(*, plan: EnginesPlan, root: str = RELEASE_ROOT) -> None:
    """Stage `plan.release` under releases/<id>, install its credentials, switch to it, gate
    and settle (switch_to).

    + plan: the engines stage's plan (hgxserve.deploy.plans.engines_plan): this host's release
      (from hgxserve.release.plan.plan_release), host path -> secret value for the units'
      credentials (pushed 0600) and this host's part in the switch
    + root: the release root on the host
    """
    reconcile_unit = files.put(
        name="Install the boot-time release reconcile unit",
        src=str(RECONCILE_UNIT),
        dest=f"/etc/systemd/system/{RECONCILE_UNIT.name}",
        mode="644",
    )
    systemd.daemon_reload(
        name="Reload systemd for the reconcile unit", _if=reconcile_unit.did_change
    )
    systemd.service(
        name="Enable the boot-time release reconcile unit",
        service=RECONCILE_UNIT.name,
        running=None,  # it runs at boot only; starting it now would be a reconcile
        enabled=True,
    )
    staged = plan.release
    if FIREWALL_FILE in staged.files:
        host_firewall()
    base = f"{root}/releases/{staged.id}"
    for path in sorted(staged.files):
        content, mode = staged.files[path]
        files.put(
            name=f"Stage {path}",
            src=io.StringIO(content),
            dest=f"{base}/tree{path}",
            mode=f"{mode:o}",
            create_remote_dir=True,
        )
    files.put(
        name=f"Write release {staged.id} ({staged.spec.topology})",
        src=io.StringIO(staged.spec.to_json()),
        dest=f"{base}/release.json",
        mode="644",
        create_remote_dir=True,
    )
    for path in sorted(plan.secret_values):
        secret_file(
            name=f"Install credential {path} (0600 in a 0700 directory)",
            dest=path,
            content=plan.secret_values[path],
        )
    if plan.fabric is not None:
        fabric_preflight(plan=plan.fabric, release_id=staged.id, root=root)
    switch_to(plan=plan.switching, root=root)


@deploy("Host firewall")
def host_firewall() -> None:
    """What the release's firewall (FIREWALL_FILE, loaded by the switch) needs besides the
    release: nft (from the host's apt sources), and the controller's address as this host sees
    it (its SSH connection's client) in the table's controller sets, reloaded when it changed;
    a table that is gone while the installed release has one is loaded again.
    """
    pinned_packages(name="Install nftables (the host firewall)", packages=["nftables"])
    address = host.get_fact(ControllerAddress)
    if address is None:
        host.noop(
            "firewall: the controller's address is unknown here ($SSH_CONNECTION unset): "
            "only firewall.allow and the topology's hosts reach the engines"
        )
    files.directory(name="The firewall's include directory", path=FIREWALL_INCLUDE_DIR, mode="755")
    controller = files.put(
        name="The controller's address in the host firewall",
        src=io.StringIO(controller_elements((address,) if address else ())),
        dest=FIREWALL_CONTROLLER_FILE,
        mode="644",
        create_remote_dir=True,
    )
    reload = [f"if [ -f {FIREWALL_FILE} ]; then {NFT} -f {FIREWALL_FILE}; fi"]
    if host.get_fact(HostFirewall) == "missing":
        server.shell(
            name="Load the host firewall again: the installed release has one, its table is gone",
            commands=reload,
        )
        return
    server.shell(
        name="Reload the host firewall with the controller's address",
        commands=reload,
        _if=controller.did_change,
    )


@deploy("Fabric preflight")
def fabric_preflight(*, plan: FabricPlan, release_id: str, root: str = RELEASE_ROOT) -> None:
    """Before any unit changes: the rails' links, ib_write_bw between the hosts the release
    crosses, and the verdict on every host of the switch (hgxserve.release.fabric).

    + plan: this host's part (hgxserve.deploy.plans.fabric_plan)
    + release_id: the staged release whose record keeps the figures (fabric.json)
    + root: the release root on the host
    """
    if plan.links:
        python.call(
            name=f"Fabric: read the rails' link state, rate and GID under {plan.sysfs}",
            function=fabric_links,
            run=plan.run,
            sysfs=plan.sysfs,
        )
    if plan.serves:
        python.call(
            name="Fabric: start the ib_write_bw servers", function=fabric_serve, run=plan.run
        )
    if plan.measures:
        python.call(
            name="Fabric: ib_write_bw to each peer host, rail by rail",
            function=fabric_measure,
            run=plan.run,
            addresses=plan.addresses,
            _serial=True,  # one host at a time: measurements must not share links
        )
    if plan.allreduce is not None:
        python.call(
            name="Fabric: NCCL all-reduce across each multi-host engine's hosts (nccl-tests)",
            function=fabric_allreduce,
            run=plan.run,
            mpirun=plan.allreduce,
            addresses=plan.addresses,
            _serial=True,  # one engine at a time, after the point-to-point runs
        )
    python.call(
        name=f"Fabric: the verdict (gate.fabric: {plan.run.policy}), kept in release {release_id}",
        function=fabric_verdict,
        run=plan.run,
        release_id=release_id,
        root=root,
    )


@deploy("Switch to a staged release")
def switch_to(*, plan: SwitchPlan, root: str = RELEASE_ROOT) -> None:
    """Switch to an already staged release (after staging it, or a rollback), gate and settle.

    + plan: the switch (hgxserve.deploy.plans.SwitchPlan): the staged release (e.g. the host's
      previous or baseline), whether this host switches and gates, the seconds the gate has
      from the moment every host switched and the slowest host may take to switch
      (switch_bound_s), this host's RDMA counters when they are P/D evidence, its engine units
      whose UCX KV endpoints cross hosts (their transport is the KV path's evidence), the SLA bench
      to run after the gate on the gate's host and the seconds it may take (the switched
      hosts' timers are extended by them)
    + root: the release root on the host
    """
    gating = bool(plan.coord.plan.switching)
    release_id, within = plan.release_id, plan.confirm_within
    step = partial(_step, plan.coord, release_id, root)
    if plan.switch:
        step("Which hosts' engines stop or start, and where the proxy runs", note_moves)
        step(
            "Pause and drain the proxy before engines of other hosts stop (503 + Retry-After)",
            pause_proxy,
        )
        switched(
            name=f"Switch to release {release_id} (pending confirmation)",
            release_id=release_id,
            confirm_within=within,
            peers_within=plan.peers_within,
            root=root,
        )
        step("All engines healthy and warm: start the proxy where it was left stopped", start_proxy)
        step(
            f"All hosts switched: each reverts in {within}s unless confirmed",
            arm_deadman,
            confirm_within=within,
        )
    if plan.switch:
        step(
            "Engines' own numbers: start time and KV capacity against the shapes' need",
            check_kv,
        )
    if gating and plan.rdma is not None:
        _rdma_counters(plan, "before", "before the gate (P/D KV evidence)")
    if plan.gate:
        step(
            "Gate the topology: proxy, models, probe answers (chat, stream), KV evidence", run_gate
        )
    if gating and plan.rdma is not None:
        _rdma_counters(plan, "after", "after the gate: they must have grown")
    if gating and plan.kv_units:
        step("Read the transport UCX selected for the KV endpoints: RDMA, not TCP", read_kv_path)
    if plan.switch and plan.bench_s:
        longer = within + plan.bench_s
        step(
            f"Bench next: each reverts in {longer}s unless confirmed",
            arm_deadman,
            confirm_within=longer,
        )
    if plan.gate and plan.bench is not None:
        step(
            f"Bench the release: scenario {plan.bench.scenario} through the proxy, SLA and "
            "regression against the last confirmed release",
            run_bench_gate,
            step=plan.bench,
        )
    if plan.switch:
        step(
            "Gate done: check no host reverted on its own, hold the timer for the settle",
            arm_deadman,
            confirm_within=within,
        )
        step(
            f"Confirm release {release_id}, or roll back if any host or the gate failed",
            settle,
            # a host whose own timer reverted it restarts the previous units: wait that long
            revert_within=max(plan.peers_within, within),
        )


def _step(
    coord: Coordination,
    release_id: str,
    root: str,
    name: str,
    function: Callable[..., Any],
    **kwargs: Any,
) -> None:
    """A step of the switch, run on the controller: `function(coord, release_id, root, ...)`."""
    python.call(
        name=name, function=function, coord=coord, release_id=release_id, root=root, **kwargs
    )


def _rdma_counters(plan: SwitchPlan, when: str, why: str) -> None:
    """This host's RDMA port counters, read `when` ("before" or "after") the gate."""
    assert plan.rdma is not None
    sysfs, devices = plan.rdma
    python.call(
        name=f"Read the RDMA port counters {why}",
        function=read_rdma_counters,
        coord=plan.coord,
        when=when,
        root=sysfs,
        devices=devices,
    )
