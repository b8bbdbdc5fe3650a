"""pyinfra fact and operations for model weights: sync/verify only when the marker is stale.

from hgxserve.weights.operations import synced, verified
synced(name="Sync model weights", options=SyncArgs("s3://models/x/", "/models/x",
       env_file="/etc/hgxserve/s3.env", endpoint_url="https://s3.example.com"))
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, operation

from hgxserve.paths import AGENT
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
