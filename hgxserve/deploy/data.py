"""The `--data` keys the deploys read, in one typed table, and the one accessor that reads them.

Every key a deploy or role reads from pyinfra's host data (`--data key=value` on the command
line, or the inventory's host data) is a row of `KEYS`: its type, its default, what it does and
which stages read it. `deploy_data(host).get(name)` returns the typed value or the default, and
raises a DeployError naming the key and the value when the value does not fit. `hgxserve
deploy-data` prints the table (docs/deploy-data.md is its markdown).

pyinfra turns `--data` values into Python values before a deploy sees them (`true` -> True,
`300` -> 300, `[..]` -> a list); the rules below accept both those and the plain text.

>>> parse_bool("load_now", "No"), parse_bool("load_now", 1)
(False, True)
>>> DeployData({"confirm_within": "120"}).get("confirm_within")
120
>>> DeployData({"runtime_find_links": "/a,/b"}).get("runtime_find_links")
('/a', '/b')
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pyinfra import logger
from pyinfra.api import DeployError
from pyinfra.api.host import Host

from hgxserve.base.defaults import S3_REQUEST_DEADLINE_S
from hgxserve.base.paths import AGENT, RDMA_SYSFS
from hgxserve.base.runstate import per_run
from hgxserve.deploy.stages import STAGES
from hgxserve.release import CONFIRM_WITHIN_S
from hgxserve.render.types import CONTAINER_TOOLS
from hgxserve.topology.cuda import DRIVER_VERSION

Kind = Literal["bool", "int", "float", "str", "list", "path", "url", "choice"]

TRUE = ("true", "1", "yes")
FALSE = ("false", "0", "no")


@dataclass(frozen=True)
class DataKey:
    """One `--data` key: its type, default, meaning, and the stages that read it."""

    name: str
    kind: Kind
    default: Any
    doc: str
    stages: tuple[str, ...]
    choices: tuple[str, ...] = ()  # a choice's values; a list's allowed items
    shown_default: str | None = None  # what an unset key means, where `default` is not it
    env: str | None = None  # the environment variable read when the key is not given
    # A tune SPEC (`deploy.data`) may set it: it changes how engines are started and judged,
    # never what is trusted (keys, pins, sources, hosts) or what runs where. Every other key
    # is the inventory's or the command line's alone.
    tunable: bool = False

    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "(unset)"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, tuple):
            return ",".join(self.default) or "(none)"
        return str(self.default)


_TOPOLOGY_STAGES = ("preflight", "provision", "runtime", "weights", "caches", "engines")
_RUNTIME = ("runtime",)

KEYS: tuple[DataKey, ...] = (
    DataKey(
        "topology", "path", None,
        "The topology file (validated before anything runs).",
        (*_TOPOLOGY_STAGES, "monitoring"),
        shown_default="$HGXSERVE_TOPOLOGY; required", env="HGXSERVE_TOPOLOGY",
    ),
    DataKey(
        "stages", "list", STAGES,
        "The stages deploys/site.py runs, in its own order (comma-separated).",
        ("site",), choices=STAGES, shown_default="all of them",
    ),
    DataKey(
        "preflight", "choice", "full",
        "`hardware` checks only what provisioning cannot fix (GPUs, RDMA ports, disk); `full` "
        "also the provisioned state and the engine runtimes.",
        ("preflight",), choices=("full", "hardware"),
    ),
    DataKey(
        "driver_version", "str", DRIVER_VERSION,
        "The NVIDIA driver (and Fabric Manager) version provisioning installs; under site.py the "
        "preflight and runtime CUDA checks are against it.",
        ("provision", "preflight", "runtime"),
    ),
    DataKey(
        "apt_source", "str", None,
        "An apt line for a local mirror instead of NVIDIA's CUDA repository.",
        ("provision",), shown_default="NVIDIA's CUDA repository",
    ),
    DataKey(
        "fabric_manager", "choice", "auto",
        "`auto`: Fabric Manager only with NVSwitch; `always`; `never`.",
        ("provision",), choices=("auto", "always", "never"),
    ),
    DataKey(
        "load_now", "bool", True,
        "Load peermem and apply sysctl now (false: write the boot config only).",
        ("provision",),
    ),
    DataKey(
        "remount_shm", "bool", True,
        "Remount /dev/shm at the topology's size now.",
        ("provision",),
    ),
    DataKey(
        "runtime_source", "choice", "wheelhouse",
        "`wheelhouse`: the controller builds and pushes the wheels; `index`: each host installs "
        "from runtime_index_url (a mirror the hosts reach).",
        _RUNTIME, choices=("wheelhouse", "index"),
    ),
    DataKey(
        "runtime_index_url", "url", None,
        "The index the wheels come from (the controller's, or with runtime_source=index the "
        "hosts').",
        _RUNTIME, shown_default="the controller's pip configuration",
    ),
    DataKey(
        "runtime_index_lock", "path", None,
        "With runtime_source=index: the lab's hash lock (every requirement name==version with "
        "--hash=sha256:, as `pip-compile --generate-hashes` writes it); hosts install only it, "
        "with --require-hashes.",
        _RUNTIME,
    ),
    DataKey(
        "runtime_index_unpinned", "bool", False,
        "With runtime_source=index: install from the mirror without a lock (its files trusted "
        "as they are; every run says so).",
        _RUNTIME,
    ),
    DataKey(
        "runtime_find_links", "list", (),
        "Local wheel directories the controller also uses (comma-separated).",
        _RUNTIME,
    ),
    DataKey(
        "runtime_no_index", "bool", False,
        "Build the wheelhouse from runtime_find_links only.",
        _RUNTIME,
    ),
    DataKey(
        "image_mirror", "str", None,
        "A registry mirror (HOST:PORT) container images are pulled through.",
        _RUNTIME,
    ),
    DataKey(
        "image_archive_prefix", "url", None,
        "Load images from OCI archives `<prefix>/sha256-<hex>.oci.tar` (verified against the "
        "digest) instead of pulling them.",
        _RUNTIME,
    ),
    DataKey(
        "image_s3_endpoint", "url", None,
        "The S3 endpoint of the image archives.",
        _RUNTIME, shown_default="the weights' S3 endpoint",
    ),
    DataKey(
        "image_s3_env_file", "path", None,
        "The env file on the host with the image archives' S3 credentials.",
        _RUNTIME, shown_default="the weights' S3 env_file",
    ),
    DataKey(
        "image_s3_addressing", "choice", None,
        "The image archives' S3 bucket addressing.",
        _RUNTIME, choices=("virtual", "path", "auto"),
        shown_default="the weights' S3 addressing, else auto",
    ),
    DataKey(
        "weights_digest", "str", None,
        "The manifest digest (sha256:...) the hosts verify the weights against and the engine "
        "units check.",
        ("weights", "engines"), shown_default="the topology's model.digest",
    ),
    DataKey(
        "model_pins", "path", None,
        "The pins file: a YAML mapping `{<model name or source URL>: sha256:...}` of the "
        "manifest digests the weights must match, kept outside the bucket (docs/weights.md "
        "\"Trust root\"). A model's pin reaches the weights stage and the engine units as "
        "model.digest does; one that differs from model.digest is refused. Set it in the "
        "inventory (inventory/lab.yml `model_pins:`).",
        _TOPOLOGY_STAGES, shown_default="no pins: the topology's model.digest only",
    ),
    DataKey(
        "allow_env", "list", (),
        "Controller environment variables the topology's `{env: VAR}` secrets may push to the "
        "hosts (comma-separated); any other is refused before anything runs. Set it in the "
        "inventory (inventory/lab.yml `allow_env:`).",
        (*_TOPOLOGY_STAGES, "monitoring"), shown_default="none",
    ),
    DataKey(
        "weights_request_deadline", "float", S3_REQUEST_DEADLINE_S,
        "Seconds all attempts of one S3 request of the weights sync may take together, "
        "backoffs included (at least one attempt's own budget); past it the sync stops with a "
        "source error (docs/weights.md \"Bounds\").",
        ("weights",),
    ),
    DataKey(
        "agent", "path", AGENT,
        "Where the hgxserve agent lives on the hosts.",
        ("weights",),
    ),
    DataKey(
        "cache_store", "path", "~/.cache/hgxserve/caches",
        "The controller's directory of baked JIT/compile caches.",
        ("caches",),
    ),
    DataKey(
        "health_timeout", "float", None,
        "Seconds an engine has to become healthy.",
        ("engines", "rollback"), shown_default="each engine's start_timeout_s", tunable=True,
    ),
    DataKey(
        "confirm_within", "int", CONFIRM_WITHIN_S,
        "Seconds the gate has, once every host switched, before a pending host reverts.",
        ("engines", "rollback"), tunable=True,
    ),
    DataKey(
        "rdma_sysfs", "path", RDMA_SYSFS,
        "Where the release's RDMA evidence reads the port counters, and the fabric preflight "
        "the ports' state, rate and GID.",
        ("engines",),
    ),
    DataKey(
        "nccl_mpirun", "path", None,
        "mpirun on a multi-host engine's head host: the fabric preflight runs nccl-tests' "
        "all_reduce_perf across the engine's hosts with it (MPI starts the other hosts' "
        "process over SSH between the hosts, which the site sets up).",
        ("engines",), shown_default="the all-reduce is not run",
    ),
    DataKey(
        "bench_tokenizer", "path", None,
        "The model's tokenizer directory on the controller, for the SLA bench (`gate.bench:`).",
        ("engines",), shown_default="AIPerf's built-in encoding",
    ),
    DataKey(
        "to", "choice", "previous",
        "The release rollback goes back to.",
        ("rollback",), choices=("previous", "baseline"),
    ),
    DataKey(
        "container_tool", "choice", "podman",
        "The container tool for `dcgm_exporter.source: container`.",
        ("monitoring",), choices=tuple(sorted(CONTAINER_TOOLS)),
    ),
)  # fmt: skip

TABLE: dict[str, DataKey] = {key.name: key for key in KEYS}
TUNABLE: tuple[str, ...] = tuple(key.name for key in KEYS if key.tunable)


def _bad(name: str, value: object, want: str) -> DeployError:
    return DeployError(f"--data {name}={value!r}: {want}")


def parse_bool(name: str, value: object) -> bool:
    """The one boolean rule: true/false, yes/no, 1/0 (any case); anything else is an error."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise _bad(name, value, "not a boolean (use true/false, yes/no or 1/0)")


def _number(key: DataKey, value: object) -> int | float:
    if isinstance(value, bool | list | tuple | dict):
        raise _bad(key.name, value, "not a number")
    try:
        number = float(value)  # type: ignore[arg-type]
    except ValueError:
        raise _bad(key.name, value, "not a number") from None
    if key.kind == "int" and not number.is_integer():
        raise _bad(key.name, value, "not a whole number")
    if number <= 0:
        raise _bad(key.name, value, "must be greater than 0")
    return int(number) if key.kind == "int" else number


def _items(key: DataKey, value: object) -> tuple[str, ...]:
    raw = value.split(",") if isinstance(value, str) else value
    if not isinstance(raw, list | tuple):
        raise _bad(key.name, value, "not a comma-separated list")
    items = tuple(str(item).strip() for item in raw if str(item).strip())
    unknown = [item for item in items if key.choices and item not in key.choices]
    if unknown:
        raise _bad(
            key.name, value, f"unknown {', '.join(unknown)}; choose from {', '.join(key.choices)}"
        )
    return items


def convert(key: DataKey, value: object) -> Any:
    """`value` as `key`'s type; a DeployError naming the key and the value otherwise."""
    if key.kind == "bool":
        return parse_bool(key.name, value)
    if key.kind in ("int", "float"):
        return _number(key, value)
    if key.kind == "list":
        return _items(key, value)
    if isinstance(value, list | tuple | dict):
        raise _bad(key.name, value, f"not a single {key.kind}")
    text = str(value)
    if key.kind == "choice" and text not in key.choices:
        raise _bad(key.name, value, f"use {', '.join(key.choices[:-1])} or {key.choices[-1]}")
    if key.kind == "url" and "://" not in text:
        raise _bad(key.name, value, "not a URL (scheme://...)")
    return text


def untunable(name: str, value: object) -> str | None:
    """Why a tune SPEC may not set `--data name=value`, or None where it may.

    >>> untunable("health_timeout", 900) is None
    True
    >>> untunable("allow_env", "AWS_SECRET_ACCESS_KEY")  # doctest: +ELLIPSIS
    'allow_env: a tune SPEC may not set it (only confirm_within, health_timeout: ...'
    """
    key = TABLE.get(name)
    if key is None or not key.tunable:
        return (
            f"{name}: a tune SPEC may not set it (only {', '.join(sorted(TUNABLE))}: the keys "
            "`hgxserve deploy-data` marks tunable); set it in the inventory or on the command line"
        )
    try:
        convert(key, value)
    except DeployError as exc:
        return str(exc)
    return None


class DataSource(Protocol):
    """pyinfra's host data (or a plain dict)."""

    def get(self, key: str, default: Any = None, /) -> Any: ...


class DeployData:
    """Typed reads of one host's data (the `--data` keys and the inventory's host data)."""

    def __init__(self, data: DataSource) -> None:
        self._data = data

    def given(self, name: str) -> bool:
        """Whether `name` has a value (an empty one counts as unset)."""
        value = self._data.get(name)
        return value is not None and value != ""

    def get(self, name: str) -> Any:
        """The typed value of `name`, or its default when unset."""
        key = TABLE[name]  # KeyError: a key the table does not know is a programming error
        if not self.given(name):
            if key.env and os.environ.get(key.env):
                return convert(key, os.environ[key.env])
            return key.default
        return convert(key, self._data.get(name))


def misspelt(given: Iterable[str]) -> dict[str, str]:
    """Keys of `given` the table lacks but that look like one of its keys -> that key.

    >>> misspelt(["health_timout", "lab_rack", "ssh_user", "topology"])
    {'health_timout': 'health_timeout'}
    """
    out = {}
    for name in given:
        if name in TABLE or name.startswith(("ssh_", "_")):
            continue  # ours, or pyinfra's own (connection keys, global arguments)
        close = difflib.get_close_matches(name, TABLE, n=1, cutoff=0.8)
        if close:
            out[name] = close[0]
    return out


def _warn_misspelt(host: Host) -> None:
    for name, key in misspelt(host.inventory.override_data).items():
        logger.warning(
            f"--data {name}: no stage reads it; did you mean {key}? (hgxserve deploy-data)"
        )


def deploy_data(host: Host) -> DeployData:
    """The typed `--data` of `host`; the first time in a run, a warning for each `--data` key
    no stage reads that looks like one that does (a typo would otherwise pass unnoticed)."""
    per_run(host.state, "misspelt-data-keys", lambda: _warn_misspelt(host))
    return DeployData(host.data)
