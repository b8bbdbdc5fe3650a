"""Bring the model weights onto this host, verified, before any engine may start.

S3 and local sources are synced into the model path with inline sha256 and verified; a CephFS
source is mounted read-only (kernel client, a .mount unit, the key by secret file) and then either
verified in place (state and marker under /var/lib/hgxserve/weights/<name>) or staged onto local
NVMe with `stage=True`. Every step is skipped when the host's marker already matches, so a second
run changes nothing.

Example:
    from roles.weights import weights
    weights(model_name="DeepSeek-V4-Flash", model_path="/models/DeepSeek-V4-Flash",
            source="s3", s3_url="s3://models/DeepSeek-V4-Flash/", addressing="virtual",
            endpoint_url="https://s3.example.com", env_file="/etc/hgxserve/s3.env")
"""

from __future__ import annotations

import os
from io import StringIO

from pyinfra import host
from pyinfra.api import DeployError, deploy
from pyinfra.facts.files import File
from pyinfra.operations import files, systemd

from hgxserve.credfiles import secret_file
from hgxserve.defaults import CEPHFS_MOUNT, S3_CONCURRENCY, S3_PART_SIZE
from hgxserve.paths import AGENT, weights_state_dir
from hgxserve.weights.cephfs import mount_unit, unit_name
from hgxserve.weights.manifest import MANIFEST_NAME
from hgxserve.weights.operations import synced, verified


@deploy("Sync and verify model weights")
def weights(
    *,
    model_name: str,
    model_path: str,
    source: str,
    s3_url: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    addressing: str = "auto",
    env_file: str | None = None,
    profile: str | None = None,
    concurrency: int = S3_CONCURRENCY,
    part_size: str = S3_PART_SIZE,
    manifest_name: str = MANIFEST_NAME,
    digest: str | None = None,
    local_path: str | None = None,
    cephfs_monitors: tuple[str, ...] = (),
    cephfs_path: str | None = None,
    cephfs_user: str | None = None,
    cephfs_secret_file: str | None = None,
    cephfs_secret_env: str | None = None,
    cephfs_mount: str = CEPHFS_MOUNT,
    stage: bool = False,
    require_sha256: bool = True,
    agent: str = AGENT,
) -> None:
    """Sync (S3, local) or mount + verify/stage (CephFS) the model; no-op when verified.

    + model_name: the model's name (names the in-place state dir)
    + model_path: where engines read the model (sync/stage destination)
    + source: "s3", "cephfs" or "local"
    + s3_url, endpoint_url, region, addressing, env_file, profile: S3 source and credentials
      reference (env_file is a 0600 file already on the host; nothing secret is passed here)
    + concurrency, part_size: ranged GETs in flight and bytes per GET
    + manifest_name: manifest object/file next to the model
    + digest: pin the manifest digest (sha256:...); otherwise any verified sync of the source
    + local_path: directory source for source="local"
    + cephfs_*: monitors, path in CephFS, CephX user, 0600 secret file on the host, mount point
    + cephfs_secret_env: controller env var holding the CephX key; pushed to cephfs_secret_file
      (0600) so the key never appears in the unit or on a command line
    + stage: copy a CephFS tree to model_path instead of verifying it in place
    + require_sha256: False is the explicit opt-out (model.integrity: size-etag): files without
      a manifest entry or S3 checksum are then accepted on size + ETag, and the log says so
    """
    manifest = None
    # the pyinfra log says so on every run that accepts files without a sha256
    opt_out = "" if require_sha256 else " (integrity OPT-OUT: size + ETag accepted)"
    if source == "s3":
        if not s3_url:
            raise DeployError("weights: source s3 needs s3_url")
        if manifest_name != MANIFEST_NAME:
            manifest = s3_url.rstrip("/") + "/" + manifest_name
        synced(
            name=f"Sync {model_name} from {s3_url} into {model_path}{opt_out}",
            src=s3_url,
            dest=model_path,
            agent=agent,
            endpoint_url=endpoint_url,
            region=region,
            addressing=addressing,
            env_file=env_file,
            profile=profile,
            concurrency=concurrency,
            part_size=part_size,
            manifest=manifest,
            digest=digest,
            require_sha256=require_sha256,
        )
        return
    if source == "local":
        if not local_path:
            raise DeployError("weights: source local needs local_path")
        if local_path.rstrip("/") == model_path.rstrip("/"):
            _verify_in_place(model_name, model_path, manifest_name, digest, agent)
        else:
            synced(
                name=f"Stage {model_name} from {local_path} into {model_path}{opt_out}",
                src=local_path,
                dest=model_path,
                agent=agent,
                concurrency=concurrency,
                part_size=part_size,
                digest=digest,
                require_sha256=require_sha256,
                manifest=None
                if manifest_name == MANIFEST_NAME
                else f"{local_path.rstrip('/')}/{manifest_name}",
            )
        return
    if source != "cephfs":
        raise DeployError(f"weights: unknown source {source!r} (s3, cephfs or local)")
    if not (cephfs_monitors and cephfs_path and cephfs_user and cephfs_secret_file):
        raise DeployError("weights: cephfs needs monitors, path, user and secret_file")
    if cephfs_secret_env:
        key = os.environ.get(cephfs_secret_env)
        if not key:
            raise DeployError(f"weights: controller env var {cephfs_secret_env} is not set")
        secret_file(
            name=f"Write the CephX secret file {cephfs_secret_file} (0600 in a 0700 directory)",
            dest=cephfs_secret_file,
            content=key.strip() + "\n",
        )
    else:  # a secret file already on the host: it must exist and be 0600
        secret = host.get_fact(File, path=cephfs_secret_file)
        if not secret:
            raise DeployError(f"weights: CephX secret file {cephfs_secret_file} is not on the host")
        if int(str(secret.get("mode", 600)), 8) & 0o077:
            raise DeployError(
                f"weights: CephX secret file {cephfs_secret_file} has mode {secret.get('mode')}; "
                "it must be 0600"
            )
    unit = unit_name(cephfs_mount)
    try:
        text = mount_unit(
            cephfs_monitors, cephfs_path, cephfs_user, cephfs_secret_file, cephfs_mount
        )
    except ValueError as exc:
        raise DeployError(f"weights: {exc}") from None
    files.directory(name=f"Create the mount point {cephfs_mount}", path=cephfs_mount)
    written = files.put(
        name=f"Write the read-only CephFS mount unit {unit}",
        src=StringIO(text),
        dest=f"/etc/systemd/system/{unit}",
        mode="644",
    )
    # React to a changed unit with _if (evaluated at run time); a bound `did_change` passed as
    # a plain argument is always truthy and would reload and remount on every run.
    systemd.daemon_reload(name=f"Reload systemd for {unit}", _if=written.did_change)
    systemd.service(
        name=f"Mount {cephfs_mount} read-only",
        service=unit,
        running=True,
        enabled=True,
    )
    systemd.service(
        name=f"Remount {cephfs_mount} with the changed unit",
        service=unit,
        running=None,  # only restarts a mount that was already up (start is the op above)
        restarted=True,
        _if=written.did_change,
    )
    if stage:
        synced(
            name=f"Stage {model_name} from CephFS into {model_path}{opt_out}",
            src=cephfs_mount,
            dest=model_path,
            agent=agent,
            concurrency=concurrency,
            part_size=part_size,
            digest=digest,
            require_sha256=require_sha256,
            manifest=None
            if manifest_name == MANIFEST_NAME
            else f"{cephfs_mount.rstrip('/')}/{manifest_name}",
        )
    else:
        _verify_in_place(model_name, cephfs_mount, manifest_name, digest, agent)


def _verify_in_place(
    model_name: str, tree: str, manifest_name: str, digest: str | None, agent: str
) -> None:
    verified(
        name=f"Verify {model_name} in place at {tree}",
        dest=tree,
        agent=agent,
        state_dir=weights_state_dir(model_name),
        manifest=f"{tree.rstrip('/')}/{manifest_name}",
        digest=digest,
    )
