"""The weights' trust root: where the sha256 the hosts enforce comes from, and which controller
environment variables the topology may push to the hosts.

Without a pin the weights stage verifies the files against the bucket's own manifest (or the S3
objects' own checksums), so whoever can write the bucket chooses what the engines load, and with
`trust_remote_code` what they run. A pin is a manifest digest held outside the bucket:
`model.digest` in the topology, or an entry of the pins file the inventory names (host data
`model_pins`), keyed by the model's name or its source (`source_key`). Both reach the weights
stage and the engine units' `check-marker` the same way (`pinned`).

    pins = load_pins("inventory/pins.yml")          # {"tiny": "sha256:..."}
    root = trust_root(topo.model, pins, "inventory/pins.yml")
    root.text()                                     # 'pins file inventory/pins.yml (tiny)'

An `{env: VAR}` secret reference pushes the controller's VAR to the hosts; only names the
inventory allows (host data `allow_env`) may be pushed (`env_refusals`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from hgxserve.topology.model import (
    CephfsSource,
    LocalSource,
    Model,
    S3Source,
    SecretRef,
    Topology,
)
from hgxserve.topology.ports import setting_path
from hgxserve.topology.problems import JsonPath, format_path

PIN = re.compile(r"^sha256:[0-9a-f]{64}$")
# a pins file is a short list written by hand; anything larger is not one
PINS_MAX_BYTES = 1 << 20


class TrustError(ValueError):
    """A pins file that cannot be read, a pin that contradicts the topology, or a model that
    must be pinned and is not."""


def load_pins(path: str) -> dict[str, str]:
    """The pins file: a YAML mapping `{<model name or source>: sha256:<64 hex>}`."""
    file = Path(path)
    try:
        if file.stat().st_size > PINS_MAX_BYTES:
            raise TrustError(f"pins file {path}: larger than {PINS_MAX_BYTES} bytes")
        data = YAML(typ="safe").load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TrustError(f"pins file {path}: cannot read it: {exc.strerror}") from None
    except YAMLError as exc:
        raise TrustError(f"pins file {path}: not YAML: {exc}") from None
    if data is None:
        return {}  # an empty pins file pins nothing
    if not isinstance(data, dict):
        raise TrustError(f"pins file {path}: not a mapping of model name or source to sha256:...")
    pins: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(value, str) or not PIN.match(value):
            raise TrustError(f"pins file {path}: {key}: {value!r} is not sha256:<64 hex digits>")
        pins[str(key)] = value
    return pins


def source_key(model: Model) -> str:
    """The pins-file key of the model's source: `s3://bucket/prefix`, `cephfs:<path>` or
    `local:<path>` (trailing slashes dropped)."""
    source = model.source
    if isinstance(source, S3Source):
        return source.url.rstrip("/")
    if isinstance(source, CephfsSource):
        return f"cephfs:{source.path.rstrip('/') or '/'}"
    assert isinstance(source, LocalSource)
    return f"local:{source.path.rstrip('/') or '/'}"


def inventory_pin(model: Model, pins: dict[str, str]) -> tuple[str, str] | None:
    """(key, digest) of the model's pin in `pins`: by name, else by source; a TrustError when
    both are there and differ."""
    found = [(key, pins[key]) for key in (model.name, source_key(model)) if key in pins]
    if len({digest for _, digest in found}) > 1:
        raise TrustError(
            f"pins file: {found[0][0]} and {found[1][0]} pin model {model.name} to different "
            "digests; keep one"
        )
    return found[0] if found else None


@dataclass(frozen=True)
class TrustRoot:
    """What the hosts verify the weights against."""

    digest: str | None  # None: the bucket's own manifest
    kind: str  # "topology", "pins", "data" (--data weights_digest=) or "bucket"
    where: str = ""  # the pins file, or the key of the pin in it

    def text(self) -> str:
        if self.kind == "topology":
            return f"model.digest {self.digest} (topology)"
        if self.kind == "pins":
            return f"pins file {self.where} ({self.digest})"
        if self.kind == "data":
            return f"--data weights_digest {self.digest}"
        return "the bucket's own manifest — not pinned"


def trust_root(model: Model, pins: dict[str, str] | None = None, pins_file: str = "") -> TrustRoot:
    """The model's trust root: `model.digest`, else its pin in `pins` (read from `pins_file`),
    else the bucket. A pin that differs from `model.digest` is a TrustError."""
    pin = inventory_pin(model, pins or {})
    if pin is not None and model.digest and pin[1] != model.digest:
        raise TrustError(
            f"model {model.name}: the topology's model.digest {model.digest} and the pins file "
            f"{pins_file} ({pin[0]}: {pin[1]}) differ; the weights cannot match both"
        )
    if model.digest:
        return TrustRoot(model.digest, "topology")
    if pin is not None:
        return TrustRoot(pin[1], "pins", pins_file)
    return TrustRoot(None, "bucket")


def remote_code_paths(topo: Topology) -> list[JsonPath]:
    """Where the topology turns trust_remote_code on (one path per place it is written)."""
    paths = [
        setting_path(topo, engine.name, "args", "trust_remote_code")
        for engine in topo.engines.values()
        if engine.args.get("trust_remote_code")
    ]
    return list(dict.fromkeys(paths))


def unpinned_refusal(topo: Topology, root: TrustRoot) -> str | None:
    """Why `topo` must not be deployed with `root`: trust_remote_code on weights that are not
    pinned (None when it may)."""
    paths = remote_code_paths(topo)
    if root.digest or not paths:
        return None
    where = topo.source_file or topo.name
    return (
        f"{where}: {format_path(paths[0])}: trust_remote_code runs Python from the model tree, "
        f"and model {topo.model.name} is not pinned: its weights would be verified only against "
        "the bucket's own manifest, so whoever can write the bucket runs code on every host. "
        "Pin the manifest digest: model.digest in the topology, or an entry "
        f"'{topo.model.name}: sha256:...' (or '{source_key(topo.model)}: sha256:...') in the "
        "pins file the inventory names (host data model_pins)"
    )


def pinned(topo: Topology, root: TrustRoot) -> Topology:
    """`topo` with `model.digest` set to the root's digest, so the weights stage and the engine
    units' check-marker enforce it exactly as a topology pin."""
    if not root.digest or root.digest == topo.model.digest:
        return topo
    model = dataclasses.replace(topo.model, digest=root.digest)
    return dataclasses.replace(topo, model=model)


def env_refs(topo: Topology) -> list[tuple[JsonPath, str]]:
    """Every `{env: VAR}` reference of the topology: (where it is written, VAR)."""
    found: list[tuple[JsonPath, SecretRef]] = []
    for engine in topo.engines.values():
        for var, ref in sorted(engine.secret_env.items()):
            found.append((setting_path(topo, engine.name, "secret_env", var), ref))
    if topo.proxy is not None:
        for name in ("api_key", "engine_api_key"):
            ref = getattr(topo.proxy, name)
            if ref is not None:
                found.append((("proxy", "auth", name), ref))
    if isinstance(topo.model.source, CephfsSource):
        found.append((("model", "source", "cephfs", "secret"), topo.model.source.secret))
    refs = [(path, ref.value) for path, ref in found if ref.kind == "env"]
    return list(dict.fromkeys(refs))


def env_refusals(topo: Topology, allowed: tuple[str, ...] | list[str]) -> list[str]:
    """One message per `{env: VAR}` reference whose VAR the inventory does not allow."""
    where = topo.source_file or topo.name
    return [
        f"{where}: {format_path(path)}: {{env: {var}}} would push the controller's environment "
        f"variable {var} to the hosts, and the inventory does not allow it; allow it with host "
        f"data allow_env (e.g. allow_env: [{var}] in the inventory, or --data allow_env={var}), "
        "or use {file: ...} / {credential: ...}"
        for path, var in env_refs(topo)
        if var not in allowed
    ]


def _one(values: list[object], key: str) -> object:
    distinct = {repr(v) for v in values}
    if len(distinct) > 1:
        raise TrustError(f"inventory: the hosts disagree on {key} ({', '.join(sorted(distinct))})")
    return values[0] if values else None


def inventory_trust(host_data: list[dict[str, object]]) -> tuple[str | None, tuple[str, ...]]:
    """(pins file, allowed env names) from the inventory's host data of the topology's hosts
    (keys `model_pins`, `allow_env`, as the deploys read them); they must agree."""
    pins = _one([d.get("model_pins") or None for d in host_data], "model_pins")
    allow = _one([d.get("allow_env") or () for d in host_data], "allow_env")
    names = allow.split(",") if isinstance(allow, str) else allow
    if not isinstance(names, list | tuple):
        raise TrustError(f"inventory: allow_env {allow!r} is not a list of names")
    return (str(pins) if pins else None), tuple(str(n).strip() for n in names if str(n).strip())
