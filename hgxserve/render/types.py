"""What rendering produces: files, units, credentials, one host's tree; shared by the engine
and proxy renderers (hgxserve.render and hgxserve.render.proxy), which import it, never each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

import jinja2

from hgxserve.digests import tree_digest
from hgxserve.errors import HgxserveError
from hgxserve.paths import CREDENTIALS_DIR, UNIT_DIR
from hgxserve.render.systemd import finalize
from hgxserve.topology.model import Engine, Role, SecretRef, Topology

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
    role: Role | Literal["proxy"]
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


def credential_for(var: str, ref: SecretRef) -> tuple[str, str, str | None]:
    """(credential name, LoadCredential= value, file the release role writes or None)."""
    if ref.kind == "credential":
        return ref.value, ref.value, None
    if ref.kind == "file":
        name = var.lower().replace("_", "-")
        return name, f"{name}:{ref.value}", None
    name = ref.value.lower().replace("_", "-")
    path = f"{CREDENTIALS_DIR}/{name}"
    return name, f"{name}:{path}", path


# vLLM reads its API key from here when --api-key is not given (never on a command line)
ENGINE_KEY_VAR = "VLLM_API_KEY"


def routed_engines(topo: Topology) -> set[str]:
    """Names of the engines the proxy sends requests to."""
    proxy = topo.proxy
    if proxy is None:
        return set()
    return {n for r in proxy.routes for n in (*r.prefill, *r.decode)} | set(proxy.combined)


def engine_secret_env(topo: Topology, engine: Engine) -> dict[str, SecretRef]:
    """The engine's secret environment, plus VLLM_API_KEY when the proxy keys its engines."""
    secrets = dict(engine.secret_env)
    key = topo.proxy.engine_api_key if topo.proxy else None
    if key is None or engine.name not in routed_engines(topo):
        return secrets
    if engine.engine != "vllm":
        raise RenderError(
            f"proxy.auth.engine_api_key: engine {engine.name} is {engine.engine}, which takes "
            "its key only as --api-key on the command line, where every local user can read it; "
            "keep it on the proxy's host (it listens on loopback there) or firewall its port, "
            "and drop engine_api_key"
        )
    if ENGINE_KEY_VAR in secrets or ENGINE_KEY_VAR in engine.env:
        raise RenderError(
            f"engine {engine.name}: {ENGINE_KEY_VAR} is set in its env/secret_env and by "
            "proxy.auth.engine_api_key; set it in one place (proxy.auth.engine_api_key)"
        )
    secrets[ENGINE_KEY_VAR] = key
    return secrets
