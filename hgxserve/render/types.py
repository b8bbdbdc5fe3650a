"""What rendering produces: files, units, credentials, one host's tree; shared by the engine
and proxy renderers (hgxserve.render and hgxserve.render.proxy), which import it, never each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

import jinja2

from hgxserve.base.digests import tree_digest
from hgxserve.base.errors import HgxserveError
from hgxserve.base.paths import UNIT_DIR
from hgxserve.base.units import finalize
from hgxserve.topology.model import Role, SecretRef

# the engines' key variable is the topology's (hgxserve.topology.wiring); named here too for the
# modules that read it beside the rendered units
from hgxserve.topology.wiring import ENGINE_KEY_VAR as ENGINE_KEY_VAR

CONTAINER_TOOLS = {"podman": "/usr/bin/podman", "docker": "/usr/bin/docker"}


class RenderError(HgxserveError):
    """The topology asks for something the renderer cannot express; the message says what."""


@dataclass(frozen=True)
class RenderedFile:
    content: str
    mode: int = 0o644


@dataclass(frozen=True)
class RenderedUnit:
    """One systemd unit: what it runs and where."""

    name: str
    engine: str | None  # None for the proxy
    role: Role | Literal["proxy", "watch"]  # "watch": the watcher of a multi-node engine
    argv: list[str]
    env: dict[str, str]
    gpus: tuple[int, ...]
    content: str
    node_rank: int = 0
    nnodes: int = 1
    # secret variables -> the LoadCredential= source each is read from (never the value)
    secret_env: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{UNIT_DIR}/{self.name}"


@dataclass(frozen=True)
class CredentialSpec:
    """A secret a unit loads with LoadCredential=.

    `path` is where the release role must write the value (mode 0600) for `env` references;
    None for `file` references (already on the host) and systemd `credential` references.
    """

    name: str
    ref: SecretRef
    path: str | None
    units: tuple[str, ...]


@dataclass(frozen=True)
class HostRender:
    host: str
    units: list[RenderedUnit]
    files: dict[str, RenderedFile]
    credentials: list[CredentialSpec] = field(default_factory=list)

    @property
    def tree(self) -> dict[str, tuple[str, int]]:
        """{path: (content, mode)}: what the release store installs on the host."""
        return {path: (f.content, f.mode) for path, f in self.files.items()}

    @property
    def digest(self) -> str:
        """The tree digest; the host's release store computes the same over its staged tree."""
        return tree_digest(self.tree)


def unit_name(name: str) -> str:
    """`hgxserve-<engine>.service` (or hgxserve-proxy.service)."""
    return f"hgxserve-{name}.service"


def watch_unit_name(engine: str) -> str:
    """`hgxserve-<engine>-watch.service`: the watcher of a multi-node engine."""
    return f"hgxserve-{engine}-watch.service"


def add_credential(
    creds: dict[str, CredentialSpec], unit: str, name: str, ref: SecretRef, path: str | None
) -> None:
    """Record that `unit` loads credential `name`; one name never stands for two secrets."""
    known = creds.get(name)
    if known is not None and (known.ref != ref or known.path != path):
        raise RenderError(
            f"credential {name!r} is used for two different secrets on one host "
            f"({known.ref.kind}:{known.ref.value} and {ref.kind}:{ref.value})"
        )
    units = (*known.units, unit) if known else (unit,)
    creds[name] = CredentialSpec(name, ref, path, units)


@cache
def templates(folder: str = "units") -> jinja2.Environment:
    """The unit templates under files/<folder> (files/units by default)."""
    root = Path(__file__).resolve().parent.parent / "files" / folder
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        # every printed value is unit text: escaped once, control characters refused
        finalize=finalize,
    )
