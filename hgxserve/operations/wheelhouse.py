"""Push a controller-built wheelhouse to a host with no internet access, for the agent and the
engine runtimes alike: the tarball goes up with `files.put`, and the shell commands that unpack
it and remove it again go into the caller's install step.

    pushed = push_wheelhouse("runtime", tarball, key, "/var/tmp/hgxserve-runtime")
    server.shell(commands=[pushed.unpack, f"pip install --find-links {pushed.path} vllm",
                           pushed.cleanup])
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from pyinfra.operations import files


@dataclass(frozen=True)
class PushedWheelhouse:
    """Where a pushed wheelhouse unpacks on the host, and the commands around its install."""

    path: str  # the directory the wheels unpack into (`--find-links`)
    unpack: str  # empty `path`, then unpack `<path>.tar` into it
    cleanup: str  # remove `path` and `<path>.tar`


def push_wheelhouse(what: str, tarball: Path, key: str, staging: str) -> PushedWheelhouse:
    """Push `tarball` to `<staging>/<key>.tar` (changes nothing when the host already has it).

    + what: whose wheelhouse, for the operation's name (`agent`, `runtime`)
    + tarball: the wheelhouse tarball on the controller
    + key: its content key: the name it is unpacked under on the host
    + staging: host directory that holds the tarball and the unpacked wheels
    """
    path = f"{staging.rstrip('/')}/{key}"
    tar = f"{path}.tar"
    files.put(
        name=f"Push the {what} wheelhouse {key} ({tarball.stat().st_size >> 20} MiB)",
        src=str(tarball),
        dest=tar,
        create_remote_dir=True,
    )
    q = shlex.quote
    return PushedWheelhouse(
        path=path,
        unpack=f"rm -rf {q(path)} && mkdir -p {q(path)} && tar -xf {q(tar)} -C {q(path)}",
        cleanup=f"rm -rf {q(path)} {q(tar)}",
    )
