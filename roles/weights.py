"""Bring the model weights onto this host, verified, before any engine may start.

S3 and local sources are synced into the model path with inline sha256 and verified; a CephFS
source is mounted read-only (kernel client, a .mount unit, the key by secret file) and then either
verified in place (state and marker under /var/lib/hgxserve/weights/<name>) or staged onto local
NVMe with `stage: true`. Every step is skipped when the host's marker already matches, so a second
run changes nothing. The role takes the topology's typed model; what it runs on the host is a
`SyncArgs` (hgxserve/weights/options.py).

Example:
    from roles.weights import weights
    weights(plan=weights_plan(host))  # hgxserve.deploy.plans, as deploys/weights.py does
    weights(model=topology.model, digest="sha256:...")
"""

from __future__ import annotations

import os
from typing import Any

from pyinfra import host
from pyinfra.api import DeployError, deploy
from pyinfra.facts.files import File
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import files, systemd

from hgxserve.base.paths import cephfs_secret_file, weights_state_dir
from hgxserve.deploy.plans import WeightsPlan, plan_or_fields
from hgxserve.operations.credentials import secret_file
from hgxserve.operations.files import file_content
from hgxserve.operations.weights import mount_started, synced, verified
from hgxserve.topology.model import CephfsSource, LocalSource, Model, S3Source
from hgxserve.weights.cephfs import mount_unit, unit_name
from hgxserve.weights.options import SyncArgs, manifest_ref


@deploy("Sync and verify model weights")
def weights(*, plan: WeightsPlan | None = None, **fields: Any) -> None:
    """Sync (S3, local) or mount + verify/stage (CephFS) the model; no-op when verified.

    + plan: the weights stage's plan (hgxserve.deploy.plans.weights_plan), or its fields as
      keywords instead:
      model: the topology's model (name, path, manifest name and typed source);
      digest: pin the manifest digest (sha256:...); otherwise any verified sync of the source;
      agent: the hgxserve agent on the host
    """
    plan = plan_or_fields(plan, WeightsPlan, fields)
    model, digest, agent = plan.model, plan.digest, plan.agent
    source = model.source
    if isinstance(source, S3Source):
        kind, ref = source.credentials or ("chain", "")
        synced(
            name=f"Sync {model.name} from {source.url} into {model.path}{_opt_out(model)}",
            options=SyncArgs(
                src=source.url,
                dest=model.path,
                concurrency=source.concurrency,
                part_size=source.part_size,
                manifest=manifest_ref(source.url, model.manifest),
                endpoint_url=source.endpoint,
                region=source.region,
                addressing=source.addressing,
                env_file=ref if kind == "env_file" else None,
                profile=ref if kind == "profile" else None,
                require_sha256=model.integrity == "sha256",
                request_deadline_s=plan.request_deadline_s,
            ),
            digest=digest,
            agent=agent,
        )
    elif isinstance(source, LocalSource):
        if source.path.rstrip("/") == model.path.rstrip("/"):
            _verify_in_place(model, model.path, digest, agent)
        else:
            _stage(model, source.path, f"Stage {model.name} from {source.path}", digest, agent)
    elif isinstance(source, CephfsSource):
        _cephfs(model, source, digest, agent)
    else:
        raise DeployError(f"weights: unknown model source {source!r}")


def _opt_out(model: Model) -> str:
    """The pyinfra log says so on every run that accepts files without a sha256."""
    return "" if model.integrity == "sha256" else " (integrity OPT-OUT: size + ETag accepted)"


def _stage(model: Model, tree: str, what: str, digest: str | None, agent: str) -> None:
    synced(
        name=f"{what} into {model.path}{_opt_out(model)}",
        options=SyncArgs(
            src=tree,
            dest=model.path,
            manifest=manifest_ref(tree, model.manifest),
            require_sha256=model.integrity == "sha256",
        ),
        digest=digest,
        agent=agent,
    )


def _cephfs_secret(source: CephfsSource) -> str:
    """The 0600 secret file on the host: the topology's file, or one written from a controller
    environment variable (the key never appears in the unit or on a command line)."""
    secret = source.secret
    if secret.kind == "file":
        existing = host.get_fact(File, path=secret.value)
        if not existing:
            raise DeployError(f"weights: CephX secret file {secret.value} is not on the host")
        if int(str(existing.get("mode", 600)), 8) & 0o077:
            raise DeployError(
                f"weights: CephX secret file {secret.value} has mode {existing.get('mode')}; "
                "it must be 0600"
            )
        return secret.value
    if secret.kind != "env":
        raise DeployError(
            f"weights: CephFS secret of kind {secret.kind!r} is not supported; use "
            "{file: /etc/ceph/<user>.secret} (0600 on the host) or {env: VAR} on the controller"
        )
    path = cephfs_secret_file(source.user)
    key = os.environ.get(secret.value)
    if not key:
        raise DeployError(f"weights: controller env var {secret.value} is not set")
    secret_file(
        name=f"Write the CephX secret file {path} (0600 in a 0700 directory)",
        dest=path,
        content=key.strip() + "\n",
    )
    return path


def _cephfs(model: Model, source: CephfsSource, digest: str | None, agent: str) -> None:
    secret = _cephfs_secret(source)
    mount = source.mount
    unit = unit_name(mount)
    try:
        text = mount_unit(source.monitors, source.path, source.user, secret, mount)
    except ValueError as exc:
        raise DeployError(f"weights: {exc}") from None
    files.directory(name=f"Create the mount point {mount}", path=mount)
    written = file_content(
        name=f"Write the read-only CephFS mount unit {unit}",
        dest=f"/etc/systemd/system/{unit}",
        content=text,
    )
    # React to a changed unit with _if (evaluated at run time); a bound `did_change` passed as
    # a plain argument is always truthy and would reload and remount on every run.
    systemd.daemon_reload(name=f"Reload systemd for {unit}", _if=written.did_change)
    # Whether it was mounted before this run, read now (planning): operations re-read their
    # facts when they execute, so a "remount if mounted" would also remount what the start
    # just mounted, on every first run.
    if host.get_fact(SystemdStatus, services=[unit]).get(unit):
        mount_started(
            name=f"Remount {mount} with the changed unit",
            unit=unit,
            restart=True,
            _if=written.did_change,
        )
    else:
        mount_started(name=f"Mount {mount} read-only", unit=unit)
    systemd.service(name=f"Mount {mount} at boot", service=unit, running=None, enabled=True)
    if source.stage:
        _stage(model, mount, f"Stage {model.name} from CephFS", digest, agent)
    else:
        _verify_in_place(model, mount, digest, agent)


def _verify_in_place(model: Model, tree: str, digest: str | None, agent: str) -> None:
    verified(
        name=f"Verify {model.name} in place at {tree}",
        dest=tree,
        agent=agent,
        state_dir=weights_state_dir(model.name),
        manifest=f"{tree.rstrip('/')}/{model.manifest}",
        digest=digest,
    )
