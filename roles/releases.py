"""Release role: stage this host's rendered tree as a release, switch to it, and take part in
the topology-wide gate so that all hosts switch together or all go back."""

from __future__ import annotations

import io
from pathlib import Path

from pyinfra.api import deploy
from pyinfra.operations import files, python, systemd

from hgxserve.base.paths import RELEASE_ROOT
from hgxserve.bench.releasegate import BenchStep, run_bench_gate
from hgxserve.operations.credentials import secret_file
from hgxserve.operations.release import (
    arm_deadman,
    read_rdma_counters,
    run_gate,
    settle,
    start_proxy,
    switched,
)
from hgxserve.release import CONFIRM_WITHIN_S
from hgxserve.release.coordination import Coordination
from hgxserve.release.plan import HostRelease

RECONCILE_UNIT = (
    Path(__file__).resolve().parent.parent
    / "hgxserve"
    / "files"
    / "release"
    / "hgxserve-release-reconcile.service"
)


@deploy("Stage and switch the release")
def release(
    *,
    plan: HostRelease,
    secret_values: dict[str, str],
    switch: bool,
    coord: Coordination,
    gate: bool,
    confirm_within: int = CONFIRM_WITHIN_S,
    peers_within: int = 0,
    rdma: tuple[str, list[str]] | None = None,
    bench: BenchStep | None = None,
    bench_s: int = 0,
    root: str = RELEASE_ROOT,
) -> None:
    """Stage `plan` under releases/<id>, switch to it when `switch`, gate and settle.

    + plan: this host's release (from hgxserve.release.plan.plan_release)
    + secret_values: host path -> secret value for the units' credentials (pushed 0600)
    + switch: this host's current release differs (decided from ReleaseState by the deploy)
    + coord: shared by all hosts of the run (who switched, the gate's verdict)
    + gate: run the topology's gate on this host (the proxy's host) after all hosts switched
    + bench: the SLA bench after the gate (`gate.bench:`), on the gate's host only
    + bench_s: seconds that bench may take (every switched host's timer is extended by it)
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
    base = f"{root}/releases/{plan.id}"
    for path in sorted(plan.files):
        content, mode = plan.files[path]
        files.put(
            name=f"Stage {path}",
            src=io.StringIO(content),
            dest=f"{base}/tree{path}",
            mode=f"{mode:o}",
            create_remote_dir=True,
        )
    files.put(
        name=f"Write release {plan.id} ({plan.spec.topology})",
        src=io.StringIO(plan.spec.to_json()),
        dest=f"{base}/release.json",
        mode="644",
        create_remote_dir=True,
    )
    for path in sorted(secret_values):
        secret_file(
            name=f"Install credential {path} (0600 in a 0700 directory)",
            dest=path,
            content=secret_values[path],
        )
    switch_to(
        release_id=plan.id,
        coord=coord,
        switch=switch,
        gate=gate,
        confirm_within=confirm_within,
        peers_within=peers_within,
        rdma=rdma,
        bench=bench,
        bench_s=bench_s,
        root=root,
    )


@deploy("Switch to a staged release")
def switch_to(
    *,
    release_id: str,
    coord: Coordination,
    switch: bool,
    gate: bool,
    confirm_within: int = CONFIRM_WITHIN_S,
    peers_within: int = 0,
    rdma: tuple[str, list[str]] | None = None,
    bench: BenchStep | None = None,
    bench_s: int = 0,
    root: str = RELEASE_ROOT,
) -> None:
    """Switch to an already staged release (rollback), with the same gate and settle steps.

    + release_id: the staged release (e.g. the host's previous or baseline)
    + confirm_within: seconds the gate has, from the moment every host switched
    + peers_within: seconds the slowest host may take to switch (see switch_bound_s)
    + rdma: (counters root, devices) when this host's RDMA counters are P/D evidence
    + bench: the SLA bench to run after the gate on this host (the gate's host)
    + bench_s: seconds the bench may take: the switched hosts' timers are extended by it
    """
    gating = bool(coord.switching)
    if switch:
        switched(
            name=f"Switch to release {release_id} (pending confirmation)",
            release_id=release_id,
            confirm_within=confirm_within,
            peers_within=peers_within,
            root=root,
        )
        python.call(
            name="All engines healthy and warm: start the proxy where it was left stopped",
            function=start_proxy,
            coord=coord,
            release_id=release_id,
            root=root,
        )
        python.call(
            name=f"All hosts switched: each reverts in {confirm_within}s unless confirmed",
            function=arm_deadman,
            coord=coord,
            release_id=release_id,
            confirm_within=confirm_within,
            root=root,
        )
    if gating and rdma is not None:
        python.call(
            name="Read the RDMA port counters before the gate (P/D KV evidence)",
            function=read_rdma_counters,
            coord=coord,
            when="before",
            root=rdma[0],
            devices=rdma[1],
        )
    if gate:
        python.call(
            name="Gate the topology: proxy, models, probe answers (chat, stream), KV evidence",
            function=run_gate,
            coord=coord,
            release_id=release_id,
            root=root,
        )
    if gating and rdma is not None:
        python.call(
            name="Read the RDMA port counters after the gate: they must have grown",
            function=read_rdma_counters,
            coord=coord,
            when="after",
            root=rdma[0],
            devices=rdma[1],
        )
    if switch and bench_s:
        python.call(
            name=f"Bench next: each reverts in {confirm_within + bench_s}s unless confirmed",
            function=arm_deadman,
            coord=coord,
            release_id=release_id,
            confirm_within=confirm_within + bench_s,
            root=root,
        )
    if gate and bench is not None:
        python.call(
            name=f"Bench the release: scenario {bench.scenario} through the proxy, SLA and "
            "regression against the last confirmed release",
            function=run_bench_gate,
            coord=coord,
            release_id=release_id,
            step=bench,
            root=root,
        )
    if switch:
        python.call(
            name="Gate done: check no host reverted on its own, hold the timer for the settle",
            function=arm_deadman,
            coord=coord,
            release_id=release_id,
            confirm_within=confirm_within,
            root=root,
        )
        python.call(
            name=f"Confirm release {release_id}, or roll back if any host or the gate failed",
            function=settle,
            coord=coord,
            release_id=release_id,
            root=root,
            # a host whose own timer reverted it restarts the previous units: wait that long
            revert_within=max(peers_within, confirm_within),
        )
