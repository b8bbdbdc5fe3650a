"""pyinfra operations for model weights: sync/verify only when the marker is stale (the fact:
hgxserve.facts.weights), and the CephFS mount.

from hgxserve.operations.weights import synced, verified
synced(name="Sync model weights", options=SyncArgs("s3://models/x/", "/models/x",
       env_file="/etc/hgxserve/s3.env", endpoint_url="https://s3.example.com"))
"""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.facts.systemd import SystemdStatus

from hgxserve.base.paths import AGENT
from hgxserve.facts.weights import ModelManifestState
from hgxserve.weights.options import SyncArgs, sync_command


def _is_current(fact: dict[str, Any], digest: str | None, source: str | None) -> bool:
    marker = fact.get("marker")
    if not marker or fact.get("check") != "ok" or fact.get("manifest_digest") != marker:
        return False
    if digest and marker != digest:
        return False
    return source is None or fact.get("source") == source


@operation()
def synced(options: SyncArgs, digest: str | None = None, agent: str = AGENT):
    """Sync options.src into options.dest and verify it, unless the marker already says so.

    + options: what `hgxserve weights sync` gets (source, destination, S3 settings, env_file:
      a 0600 file on the host with AWS_* credentials, never the secret itself)
    + digest: required manifest digest (sha256:...); without it any verified sync of the source
    + agent: the hgxserve agent on the host

    **Example:**

    .. code:: python

        synced(name="Sync model weights",
               options=SyncArgs("s3://models/x/", "/models/x", env_file="/etc/hgxserve/s3.env"))
    """
    dest, state_dir = options.dest, options.state_dir
    fact = host.get_fact(ModelManifestState, dest=dest, state_dir=state_dir, agent=agent)
    if _is_current(fact, digest, options.src):
        host.noop(f"model at {dest} is already verified ({fact['marker']})")
        return
    yield StringCommand(sync_command(options, agent=agent, digest=digest))


@operation()
def verified(
    dest: str,
    agent: str = AGENT,
    state_dir: str | None = None,
    manifest: str | None = None,
    digest: str | None = None,
):
    """Verify DEST (e.g. a read-only CephFS mount) in place, unless its marker is current.

    + dest: the model tree
    + state_dir: where state and marker live (outside DEST for a read-only mount)
    + manifest: manifest file (default: state copy, then DEST/hgxserve-manifest.json)
    + digest: required manifest digest

    **Example:**

    .. code:: python

        verified(name="Verify model on CephFS", dest="/mnt/hgxserve-models",
                 state_dir="/var/lib/hgxserve/weights/DeepSeek-V4-Flash")
    """
    fact = host.get_fact(ModelManifestState, dest=dest, state_dir=state_dir, agent=agent)
    if _is_current(fact, digest, None):
        host.noop(f"model at {dest} is already verified ({fact['marker']})")
        return
    q = shlex.quote
    command = [q(agent), "weights", "verify", q(dest), "-q"]
    for flag, value in (("--state-dir", state_dir), ("--manifest", manifest), ("--digest", digest)):
        if value:
            command += [flag, q(value)]
    yield StringCommand(" ".join(command))


# what the kernel client's usual refusals mean, printed with a failed mount's log
MOUNT_ERRORS = (
    "mount error 13: wrong user (name=), key (secretfile=) or a path outside its caps, "
    "2: no such path, 110: no monitor answered"
)


@operation()
def mount_started(unit: str, restart: bool = False):
    """Start a .mount unit unless it is mounted, or (`restart`) remount it. When the mount
    fails, the mount helper's own lines of this attempt (`mount error 13 = Permission denied`)
    go to stderr, so the deploy's output names the cause, not only systemd's "Job ... failed".

    + unit: the .mount unit (escaped name, e.g. `mnt-hgxserve\\x2dmodels.mount`)
    + restart: remount (its unit file changed; the caller knows it was mounted before the run)

    **Example:**

    .. code:: python

        mount_started(name="Mount the model store", unit="mnt-models.mount")
    """
    if not restart and host.get_fact(SystemdStatus, services=[unit]).get(unit):
        host.noop(f"{unit} is mounted")
        return
    u = shlex.quote(unit)
    yield StringCommand(
        f"since=$(date +%s); systemctl {'restart' if restart else 'start'} {u} || {{ rc=$?; "
        f"echo {shlex.quote(f'{unit} did not mount; {MOUNT_ERRORS}; its log:')} >&2; "
        f"journalctl -u {u} --since @$since --no-pager -o cat >&2; exit $rc; }}"
    )
