"""pyinfra fact and operations for model weights: sync/verify only when the marker is stale.

from hgxserve.weights.operations import synced, verified
synced(name="Sync model weights", src="s3://models/x/", dest="/models/x",
       env_file="/etc/hgxserve/s3.env", endpoint_url="https://s3.example.com")
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, operation

from hgxserve.defaults import S3_CONCURRENCY, S3_PART_SIZE
from hgxserve.paths import AGENT
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


def sync_command(
    src: str,
    dest: str,
    *,
    agent: str = AGENT,
    state_dir: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    addressing: str = "auto",
    env_file: str | None = None,
    profile: str | None = None,
    concurrency: int = S3_CONCURRENCY,
    part_size: str = S3_PART_SIZE,
    manifest: str | None = None,
    digest: str | None = None,
    require_sha256: bool = True,
) -> str:
    """The agent command line: paths and options only, never a secret (those stay in env_file).

    sync_command("s3://models/x/", "/models/x", env_file="/etc/hgxserve/s3.env")
    """
    q = shlex.quote
    sync = [
        q(agent),
        "weights",
        "sync",
        q(src),
        q(dest),
        "--concurrency",
        str(concurrency),
        "--part-size",
        q(part_size),
        "-q",
    ]
    if src.startswith("s3://"):
        sync += ["--addressing", q(addressing)]
        for flag, value in (
            ("--endpoint-url", endpoint_url),
            ("--region", region),
            ("--env-file", env_file),
            ("--profile", profile),
        ):
            if value:
                sync += [flag, q(value)]
    if manifest:
        sync += ["--manifest", q(manifest)]
    if state_dir:
        sync += ["--state-dir", q(state_dir)]
    if not require_sha256:
        sync.append("--allow-size-etag")
    verify = [q(agent), "weights", "verify", q(dest), "-q"]
    if state_dir:
        verify += ["--state-dir", q(state_dir)]
    if digest:
        verify += ["--digest", q(digest)]
    return " ".join(sync) + " && " + " ".join(verify)


@operation()
def synced(
    src: str,
    dest: str,
    agent: str = AGENT,
    state_dir: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    addressing: str = "auto",
    env_file: str | None = None,
    profile: str | None = None,
    concurrency: int = S3_CONCURRENCY,
    part_size: str = S3_PART_SIZE,
    manifest: str | None = None,
    digest: str | None = None,
    require_sha256: bool = True,
):
    """Sync SRC into DEST and verify it, unless DEST's marker already says so.

    + src: s3://bucket/prefix/ or a directory (a CephFS mount when staging)
    + dest: model directory on the host
    + env_file: 0600 file on the host with AWS_* credentials (never on the command line)
    + digest: required manifest digest (sha256:...); without it any verified sync of SRC counts
    + require_sha256: False is the explicit opt-out (model.integrity: size-etag)
    + other arguments: see `hgxserve weights sync --help`

    **Example:**

    .. code:: python

        synced(name="Sync model weights", src="s3://models/x/", dest="/models/x",
               env_file="/etc/hgxserve/s3.env", addressing="virtual")
    """
    fact = host.get_fact(ModelManifestState, dest=dest, state_dir=state_dir, agent=agent)
    if _is_current(fact, digest, src):
        host.noop(f"model at {dest} is already verified ({fact['marker']})")
        return
    yield StringCommand(
        sync_command(
            src,
            dest,
            agent=agent,
            state_dir=state_dir,
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
    )


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
