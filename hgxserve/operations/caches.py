"""pyinfra operations for JIT/compile caches: bake, fetch, restore (facts: hgxserve.facts.caches).

Controller-mediated distribution: one host per (GPU kind, key) bakes and packs; its archive is
fetched into a store on the controller (`<store>/<full key>/<sha256>.tar.zst` plus
`<store>/<full key>.json`); every other host of that kind gets it pushed and restored. A host
whose restore marker already names the same full key and archive changes nothing.

    from hgxserve.operations.caches import restored
    restored(name="Restore JIT cache", key=key, full_key=full_key, store="/srv/caches")
"""

from __future__ import annotations

import json
import os
import re
from io import BytesIO
from typing import Any

from pyinfra import host
from pyinfra.api import FunctionCommand, OperationError, StringCommand, operation
from pyinfra.api.command import FileUploadCommand, QuoteString

from hgxserve.base.cachelayout import DEFAULT_ROOT, RESTORE_MARKER
from hgxserve.base.defaults import ENGINE_USER
from hgxserve.base.paths import AGENT
from hgxserve.caches.archive import sha256_of
from hgxserve.facts.caches import CacheNotOwned, CacheState


def shell_words(*words: str) -> StringCommand:
    """One shell command with every word quoted: cache.root and keys come from the topology.

    >>> str(shell_words("mkdir", "-p", "/x;touch /var/p;#"))
    "mkdir -p '/x;touch /var/p;#'"
    """
    return StringCommand(*(QuoteString(w) for w in words))


def store_index(store: str, full_key: str) -> dict[str, Any] | None:
    """The controller store's record for a full key, or None when nothing was baked yet."""
    try:
        with open(os.path.join(store, f"{full_key}.json")) as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(value.get("sha256"))):
        return None
    return value


# What of a key directory is handed to the engine user: directories and files of one link
# (a hard link to a file elsewhere, where fs.protected_hardlinks is off, is never chowned).
HANDED_OVER = ("(", "-type", "d", "-o", "-links", "1", ")")


def hand_over(root: str, key: str, owner: str) -> StringCommand:
    """Give a key directory and everything in it to the engine user its units run as (a
    restore or bake runs as root; the engines write their JIT caches there). Depth first:
    each directory changes owner after what is in it, so no directory on the way is the
    user's (to swap for a link) while entries under it are handed over; links themselves,
    never what they point at."""
    return shell_words(
        "find", f"{root}/{key}", "-depth", "!", "-user", owner, *HANDED_OVER,
        "-exec", "chown", "--no-dereference", f"{owner}:{owner}", "{}", "+",
    )  # fmt: skip


def _restore_commands(  # noqa: PLR0913 - the restore operation's own arguments, passed on
    key: str, full_key: str, root: str, archive: str, sha256: str, agent: str
) -> list[Any]:
    remote = f"{root}/.archives/{sha256}.tar.zst"
    return [
        shell_words("mkdir", "-p", f"{root}/.archives"),
        FileUploadCommand(archive, remote),
        shell_words(
            agent,
            "cache",
            "restore",
            "--archive",
            remote,
            "--dir",
            f"{root}/{key}",
            "--sha256",
            sha256,
            "--key",
            full_key,
        ),  # fmt: skip
        shell_words("rm", "-f", remote),
    ]


def _owned(root: str, key: str, owner: str, done: str) -> Any:
    """Nothing to restore or bake (`done` says why): hand the key directory to `owner` when
    anything in it is not its own yet (a cache restored before the engines ran as `owner`)."""
    if key in host.get_fact(CacheNotOwned, root=root, user=owner):
        yield hand_over(root, key, owner)
        return
    host.noop(done)


def _push_and_restore_late(  # noqa: PLR0913 - the restore operation's own arguments, passed on
    state: Any, host: Any, key: str, full_key: str, root: str, store: str, agent: str
) -> None:
    # Runs at execution time: the archive may have been baked earlier in this same run.
    index = store_index(store, full_key)
    if index is None:
        raise OperationError(
            f"no cache archive for key {full_key} in {store}: bake it on a host with the same "
            f"facts (policy: bake), or run `hgxserve cache bake` there"
        )
    archive = os.path.join(store, full_key, f"{index['sha256']}.tar.zst")
    for command in _restore_commands(key, full_key, root, archive, index["sha256"], agent):
        if isinstance(command, FileUploadCommand):
            ok = host.put_file(command.src, command.dest)
        else:
            ok, _ = host.run_shell_command(command)
        if not ok:
            raise OperationError(f"cache restore of {full_key} failed at: {command}")


@operation()
def restored(
    key: str,
    full_key: str,
    root: str = DEFAULT_ROOT,
    store: str = "",
    agent: str = AGENT,
):
    """Hold the archive of `full_key` in `<root>/<key>/`, pushed from the controller store,
    owned by the user the engine units run as (User=, hgxserve.base.defaults.ENGINE_USER).

    + key: render-time key (the directory the units use)
    + full_key: key with this host's facts (what the archive was baked for)
    + root: cache root on the host
    + store: controller directory with `<full_key>.json` and `<full_key>/<sha256>.tar.zst`
    + agent: the hgxserve command on the host

    Example:
        restored(name="Restore JIT cache", key=k, full_key=fk, store="/srv/caches")
    """
    have = host.get_fact(CacheState, root=root).get(key) or {}
    index = store_index(store, full_key)
    if have.get("full_key") == full_key and (
        index is None or have.get("archive_sha256") == index.get("sha256")
    ):
        held = f"cache {key} already holds {full_key} ({str(have.get('archive_sha256'))[:12]})"
        yield from _owned(root, key, ENGINE_USER, held)
        return
    if index is None:
        # Baked earlier in this run on another host: resolve the archive when executing.
        yield FunctionCommand(
            _push_and_restore_late, (key, full_key, root, store, agent), {}
        )  # fmt: skip
    else:
        archive = os.path.join(store, full_key, f"{index['sha256']}.tar.zst")
        if not os.path.isfile(archive):
            raise OperationError(f"{archive}: listed in {store}/{full_key}.json but missing")
        yield from _restore_commands(key, full_key, root, archive, index["sha256"], agent)
    yield hand_over(root, key, ENGINE_USER)


def _fetch_baked(  # noqa: PLR0913 - pyinfra python.call: state and host first, then the bake's
    state: Any, host: Any, key: str, full_key: str, root: str, store: str
) -> None:
    marker_path = f"{root}/{key}/{RESTORE_MARKER}"
    ok, output = host.run_shell_command(shell_words("cat", marker_path))
    if not ok:
        raise OperationError(f"{host.name}: bake left no marker at {marker_path}")
    try:
        marker = json.loads("\n".join(output.stdout_lines))
        claimed = str(marker["archive_sha256"])
    except (ValueError, KeyError, TypeError):
        raise OperationError(f"{host.name}: bake marker {marker_path} is not readable") from None
    if not re.fullmatch(r"[0-9a-f]{64}", claimed):
        # the name goes into paths here and on every host: only a digest is accepted
        raise OperationError(f"{host.name}: bake marker names archive {claimed[:80]!r}")
    os.makedirs(os.path.join(store, full_key), exist_ok=True)
    part = os.path.join(store, full_key, f".{claimed}.tar.zst.part")
    if not host.get_file(f"{root}/.archives/{claimed}.tar.zst", part):
        raise OperationError(f"{host.name}: cannot fetch {root}/.archives/{claimed}.tar.zst")
    # The digest every other host checks comes from the controller's own hash of what it
    # received, never from what the baking host says about its archive.
    sha = sha256_of(part)
    if sha != claimed:
        os.unlink(part)
        raise OperationError(
            f"{host.name}: fetched archive hashes to {sha}, but its bake marker says {claimed}; "
            "not stored"
        )
    local = os.path.join(store, full_key, f"{sha}.tar.zst")
    os.replace(part, local)
    with open(os.path.join(store, f"{full_key}.json.part"), "w") as fh:
        json.dump(
            {"sha256": sha, "key": key, "baked_on": host.name, "hashed_by": "controller"},
            fh,
            indent=1,
        )
    os.replace(
        os.path.join(store, f"{full_key}.json.part"), os.path.join(store, f"{full_key}.json")
    )


@operation()
def baked(  # noqa: PLR0913 - a pyinfra operation: one keyword per option, as pyinfra's own
    key: str,
    full_key: str,
    topology: str,
    engine: str,
    facts: dict[str, Any],
    root: str = DEFAULT_ROOT,
    store: str = "",
    agent: str = AGENT,
):
    """Bake `full_key` on this host (unless it holds it), pack it and fetch it to the store.

    + key / full_key: render-time key and full key (see `restored`)
    + topology: path of the topology file on the controller (uploaded for the bake)
    + engine: engine name in the topology
    + facts: this host's key facts (CacheKeyFacts), recorded with the bake
    + root / store / agent: as in `restored`; the engine bakes as the units run (ENGINE_USER)

    Example:
        baked(name="Bake JIT cache", key=k, full_key=fk, topology="t.yml", engine="decode-0",
              facts=f, store="/srv/caches")
    """
    have = host.get_fact(CacheState, root=root).get(key) or {}
    index = store_index(store, full_key)
    if have.get("full_key") == full_key and (
        index is None or have.get("archive_sha256") == index.get("sha256")
    ):
        if index is None:
            # Baked before but never fetched: fetch only.
            yield FunctionCommand(_fetch_baked, (key, full_key, root, store), {})
            return
        yield from _owned(root, key, ENGINE_USER, f"cache {key} already baked as {full_key}")
        return
    work = f"{root}/.bake"
    remote_topology = f"{work}/{os.path.basename(topology)}"
    remote_facts = f"{work}/{full_key}.facts.json"
    yield shell_words("mkdir", "-p", work, f"{root}/.archives")
    yield FileUploadCommand(topology, remote_topology)
    yield FileUploadCommand(BytesIO(json.dumps(facts, sort_keys=True).encode()), remote_facts)
    yield shell_words(
        agent, "cache", "bake", "--topology", remote_topology, "--engine", engine,
        "--host", host.name, "--facts", remote_facts, "--pack-to", f"{root}/.archives/",
        "--user", ENGINE_USER,
    )  # fmt: skip
    yield hand_over(root, key, ENGINE_USER)  # the bake record and marker were written as root
    yield FunctionCommand(_fetch_baked, (key, full_key, root, store), {})
