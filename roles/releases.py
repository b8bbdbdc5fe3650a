"""Release role: stage this host's rendered tree as a release, switch to it, and take part in
the topology-wide gate so that all hosts switch together or all go back."""

from __future__ import annotations

import io
from pathlib import Path

from pyinfra.api import deploy
from pyinfra.operations import files, python, systemd

from hgxserve.credfiles import secret_file
from hgxserve.paths import RELEASE_ROOT
from hgxserve.release.ops import Coordination, run_gate, settle, switched
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
    confirm_within: int = 300,
    root: str = RELEASE_ROOT,
) -> None:
    """Stage `plan` under releases/<id>, switch to it when `switch`, gate and settle.

    + plan: this host's release (from hgxserve.release.plan.plan_release)
    + secret_values: host path -> secret value for the units' credentials (pushed 0600)
    + switch: this host's current release differs (decided from ReleaseState by the deploy)
    + coord: shared by all hosts of the run (who switched, the gate's verdict)
    + gate: run the topology's gate on this host (the proxy's host) after all hosts switched
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
        root=root,
    )


@deploy("Switch to a staged release")
def switch_to(
    *,
    release_id: str,
    coord: Coordination,
    switch: bool,
    gate: bool,
    confirm_within: int = 300,
    root: str = RELEASE_ROOT,
) -> None:
    """Switch to an already staged release (rollback), with the same gate and settle steps.

    + release_id: the staged release (e.g. the host's previous or baseline)
    """
    if switch:
        switched(
            name=f"Switch to release {release_id} (pending confirmation)",
            release_id=release_id,
            confirm_within=confirm_within,
            root=root,
        )
    if gate:
        python.call(
            name="Gate the topology: proxy health, models, deterministic completion, KV transfer",
            function=run_gate,
            coord=coord,
            release_id=release_id,
            root=root,
        )
    if switch:
        python.call(
            name=f"Confirm release {release_id}, or roll back if any host or the gate failed",
            function=settle,
            coord=coord,
            release_id=release_id,
            root=root,
        )
