"""pyinfra fact and operations for model weights: sync/verify only when the marker is stale.

from hgxserve.weights.operations import synced, verified
synced(name="Sync model weights", options=SyncArgs("s3://models/x/", "/models/x",
       env_file="/etc/hgxserve/s3.env", endpoint_url="https://s3.example.com"))
"""

from __future__ import annotations

import hashlib
import json
import shlex
from io import StringIO
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, operation
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import files

from hgxserve.base.paths import AGENT
from hgxserve.weights.options import SyncArgs
from hgxserve.weights.state import STATE_DIR_NAME


class ModelManifestState(FactBase):
    """The marker, the state record's source/digest, and a stat-only marker check of a tree.

    Example:
        >>> host.get_fact(ModelManifestState, dest="/models/x")  # doctest: +SKIP
        {'marker': 'sha256:9f2c...', 'source': 's3://models/x/', 'manifest_digest':
         'sha256:9f2c...', 'files': 55, 'check': 'ok'}
    """

    def command(self, dest: str, state_dir: str | None = None, agent: str = AGENT) -> str:
        directory = state_dir or f"{dest.rstrip('/')}/{STATE_DIR_NAME}"
        d, a = shlex.quote(directory), shlex.quote(agent)
        check = f"{a} weights check-marker {shlex.quote(dest)} -q"
        if state_dir:
            check += f" --state-dir {d}"
        # The agent may not be installed yet on a fresh host: then the check says "absent".
        return (
            f"echo '##marker'; cat {d}/verified 2>/dev/null; "
            f"echo '##state'; cat {d}/state.json 2>/dev/null; "
            f"echo '##check'; if [ -x {a} ]; then {check} >/dev/null 2>&1 "
            "&& echo ok || echo stale; else echo absent; fi"
        )

    @staticmethod
    def default() -> dict[str, Any]:
        return {}

    def process(self, output: list[str]) -> dict[str, Any]:
        return parse_manifest_state(output)


def parse_manifest_state(lines: list[str]) -> dict[str, Any]:
    """Parse ModelManifestState output; anything unreadable counts as not verified.

    >>> parse_manifest_state(["##marker", "sha256:ab", "##state", "{}", "##check", "ok"])
    {'marker': 'sha256:ab', 'source': None, 'manifest_digest': None, 'files': 0, 'check': 'ok'}
    """
    sections: dict[str, list[str]] = {}
    current = ""
    for line in lines:
        if line.startswith("##"):
            current = line[2:].strip()
            sections[current] = []
        elif current:
            sections[current].append(line)
    marker = "".join(sections.get("marker", [])).strip() or None
    try:
        state = json.loads("\n".join(sections.get("state", [])) or "{}")
    except ValueError:
        state = {}
    if not isinstance(state, dict):
        state = {}
    return {
        "marker": marker,
        "source": state.get("source"),
        "manifest_digest": state.get("manifest_digest"),
        "files": len(state.get("files") or {}),
        "check": "".join(sections.get("check", [])).strip() or "absent",
    }


def _is_current(fact: dict[str, Any], digest: str | None, source: str | None) -> bool:
    marker = fact.get("marker")
    if not marker or fact.get("check") != "ok" or fact.get("manifest_digest") != marker:
        return False
    if digest and marker != digest:
        return False
    return source is None or fact.get("source") == source


def sync_command(options: SyncArgs, *, agent: str = AGENT, digest: str | None = None) -> str:
    """The agent command line: sync, then verify (paths and options only, never a secret).

    sync_command(SyncArgs("s3://models/x/", "/models/x", env_file="/etc/hgxserve/s3.env"))
    """
    q = shlex.quote
    sync = " ".join(q(word) for word in [agent, "weights", *options.to_argv()])
    verify = [q(agent), "weights", "verify", q(options.dest), "-q"]
    if options.state_dir:
        verify += ["--state-dir", q(options.state_dir)]
    if digest:
        verify += ["--digest", q(digest)]
    return sync + " && " + " ".join(verify)


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


class FileDigest(FactBase):
    """A file's mode and the sha256 of its content, or None when it is not a file.

    pyinfra's own file hash facts parse `sha1sum PATH`, which GNU coreutils prints as
    `\\<hash>  <escaped path>` when the path holds a backslash, as every escaped mount unit
    name does (`mnt-hgxserve\\x2dmodels.mount`): the fact then reads "no such file" and
    `files.put` uploads on every run. Hashing stdin names no path.

    Example:
        >>> FileDigest().process(["644", "ab" * 32 + "  -"])
        ('644', 'abababababababababababababababababababababababababababababababab')
    """

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        return f"if [ -f {p} ]; then stat -c %a {p} && sha256sum < {p}; fi"

    def process(self, output: list[str]) -> tuple[str, str] | None:
        if len(output) < 2 or not output[1].split():
            return None
        return output[0].strip(), output[1].split()[0]


@operation()
def file_content(dest: str, content: str, mode: str = "644"):
    """Hold `content` in `dest` with `mode`; unchanged when both already match.

    + dest: absolute path on the host (any name: compared without printing it)
    + content: the file's text
    + mode: octal mode

    **Example:**

    .. code:: python

        file_content(name="Mount unit", dest="/etc/systemd/system/mnt-m.mount", content=text)
    """
    want = (mode.lstrip("0") or "0", hashlib.sha256(content.encode()).hexdigest())
    have = host.get_fact(FileDigest, path=dest)
    if have and tuple(have) == want:
        host.noop(f"{dest} is up to date")
        return
    yield from files.put._inner(src=StringIO(content), dest=dest, mode=mode, force=True)


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
