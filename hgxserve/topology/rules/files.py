"""Rules on files the hosts get: file-source, file-source-place, engine-path-provided.

Every file under files: exists on the controller with its sha256 and lies in the topology's
folder (unless accepted by its path), and every host path an engine arg names is provided by a
shipped file, the model or the runtime.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from hgxserve.base.digests import shipped_file_sha256
from hgxserve.base.paths import TOPOLOGY_FILES_DIR
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.problems import JsonPath, format_path
from hgxserve.topology.registry import Finding, engine_rule, rule
from hgxserve.topology.rules.common import accept_hint

FAMILY = ("file-source", "file-source-place", "engine-path-provided")


@rule(
    "file-source",
    "error",
    "Every file under files: exists on the controller with its sha256.",
    why=(
        "the runtime stage ships exactly the pinned content; a wrong digest is caught before "
        "any host is touched"
    ),
)
def file_source(topo: Topology) -> Iterator[Finding]:
    for name, spec in topo.files.items():
        if spec.is_url:
            continue  # fetched by the controller at deploy time and checked against sha256
        written = topo.raw.get("files", {}).get(name, {}).get("source", spec.source)
        try:
            actual = shipped_file_sha256(spec.source)
        except OSError as exc:
            yield (
                ("files", name, "source"),
                f"cannot read {written}: {exc.strerror or exc}; the runtime stage ships this "
                "file to the hosts (a path relative to the topology file, or absolute)",
            )
            continue
        if actual == spec.sha256:
            continue
        if _outside_folder(topo, spec.source) and not _accepted(topo, name):
            # file-source-place refuses it: its digest would confirm a guess of its content
            yield (
                ("files", name, "sha256"),
                f"{written} does not have sha256 {spec.sha256} (its own digest is not shown: the "
                "file lies outside the topology's folder and is refused by file-source-place)",
            )
            continue
        yield (
            ("files", name, "sha256"),
            f"{written} has sha256 {actual}, not {spec.sha256}: set sha256: {actual} "
            "if the new content is intended",
        )


def _outside_folder(topo: Topology, source: str) -> bool:
    """Whether `source` lies outside the topology file's folder (its links resolved)."""
    if not topo.source_file:
        return False
    folder = os.path.realpath(os.path.dirname(os.path.abspath(topo.source_file)))
    return os.path.commonpath([os.path.realpath(source), folder]) != folder


def _accepted(topo: Topology, name: str) -> bool:
    """Whether the topology accepts `files.<name>.source` by its path (`accept:`)."""
    return format_path(("files", name, "source")) in (topo.raw.get("accept") or {})


@rule(
    "file-source-place",
    "error",
    "files: sources lie in the topology's folder (or below it), unless accepted by path.",
    why=(
        "files: ships the file to every host world-readable: a source outside the topology's "
        "folder could be any controller file (a key, a credential)"
    ),
)
def file_source_place(topo: Topology) -> Iterator[Finding]:
    folder = os.path.dirname(os.path.abspath(topo.source_file)) if topo.source_file else None
    if folder is None:
        return
    for name, spec in topo.files.items():
        if spec.is_url:
            continue  # pinned by sha256 and fetched by the controller
        real = os.path.realpath(spec.source)
        if os.path.commonpath([real, os.path.realpath(folder)]) == os.path.realpath(folder):
            continue
        path: JsonPath = ("files", name, "source")
        written = topo.raw.get("files", {}).get(name, {}).get("source", spec.source)
        yield (
            path,
            f"{written} lies outside the topology's folder: any file of the controller would "
            f"be shipped to the hosts (world-readable); {accept_hint(path)}",
        )


def _setting_or_arg_path(topo: Topology, engine: Engine, keys: tuple[str, ...]) -> JsonPath:
    if keys[0] != "extra_args":
        return setting_path(topo, engine.name, *keys)
    index = int(keys[1])  # merged extra_args: the defaults' first, then the engine's own
    inherited = len(topo.raw.get("defaults", {}).get("extra_args", []))
    if index < inherited:
        return ("defaults", "extra_args", index)
    return ("engines", engine.name, "extra_args", index - inherited)


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/")


@engine_rule(
    "engine-path-provided",
    "error",
    "A host path an engine arg names is provided: a topology file, the model, the runtime.",
    why=("nothing else puts files on the hosts: the engine would fail at start on a clean host"),
)
def engine_path_provided(topo: Topology, engine: Engine) -> Iterator[Finding]:
    shipped = {spec.host_path: name for name, spec in topo.files.items()}
    roots = [topo.model.path, topo.cache.root]
    if engine.runtime is not None and engine.runtime.venv:
        roots.append(engine.runtime.venv)
    for keys, flag, path in engine.host_paths():
        if path in shipped or any(_under(path, root) for root in roots):
            continue
        name = path.rsplit("/", 1)[-1] or "file"
        yield (
            _setting_or_arg_path(topo, engine, keys),
            f"{flag} points at {path}, which nothing provides on the hosts: add it under "
            f"files: (e.g. files: {{{name}: {{source: ..., sha256: ...}}}}) and point at "
            f"{TOPOLOGY_FILES_DIR}/{name}, or use a path inside the model "
            f"({topo.model.path}) or the runtime",
        )
