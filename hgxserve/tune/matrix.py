"""A matrix over the base topology, expanded to concrete topology files.

Per role (prefill, decode, combined) the matrix lists values of `tp`, `dp`, `ep`, `count` (how
many instances of the role: the P:D ratio), `max_num_seqs`, `max_num_batched_tokens` and
`engine`. Each combination copies the base, replaces that role's engines by `count` copies of its
first engine (named `<role>-<i>`) with the values set, places them on the base's hosts (the first
host, in the base's order, with enough free GPUs; GPUs of engines the matrix leaves alone stay
taken), moves their ports (API, KV side channel) up past those other engines on the same host
use, and points the proxy's routes at them. A combination that cannot be placed keeps an
overlapping placement, so that `validate` prunes it with its reason instead of it disappearing.

>>> combos = combinations({"prefill": {"count": [1, 2]}, "decode": {"tp": [2, 4]}})
>>> [(c["prefill"]["count"], c["decode"]["tp"]) for c in combos]
[(1, 2), (1, 4), (2, 2), (2, 4)]
"""

from __future__ import annotations

import copy
import itertools
import shutil
from pathlib import Path
from typing import Any

import yaml

from hgxserve.base.errors import UsageError

# axis -> where it lives in an engine's settings
_ARGS_AXES = ("max_num_seqs", "max_num_batched_tokens")
_ENGINE_AXES = ("tp", "dp", "ep", "engine")
NAME_MAX = 40  # the topology schema's name pattern


def combinations(matrix: dict[str, dict[str, list[Any]]]) -> list[dict[str, dict[str, Any]]]:
    """Every combination of the matrix's values, role by role, axis by axis (in written order)."""
    keys = [(role, axis) for role, axes in matrix.items() for axis in axes]
    out = []
    for values in itertools.product(*(matrix[role][axis] for role, axis in keys)):
        combo: dict[str, dict[str, Any]] = {}
        for (role, axis), value in zip(keys, values, strict=True):
            combo.setdefault(role, {})[axis] = value
        out.append(combo)
    return out


def label(combo: dict[str, dict[str, Any]]) -> str:
    """`prefill tp=2 count=2; decode tp=4`: what a combination sets, for people."""
    return "; ".join(
        f"{role} " + " ".join(f"{k}={v}" for k, v in axes.items()) for role, axes in combo.items()
    )


def _gpus_of(engine: dict[str, Any], defaults: dict[str, Any]) -> int:
    merged = {**defaults, **engine}
    return int(merged.get("tp", 1)) * int(merged.get("dp", 1)) * int(merged.get("pp", 1))


def _free(hosts: dict[str, Any], engines: dict[str, Any]) -> dict[str, list[int]]:
    """GPUs of each host that no engine places on."""
    taken: dict[str, set[int]] = {h: set() for h in hosts}
    for engine in engines.values():
        for host, gpus in (engine.get("place") or {}).items():
            taken.setdefault(host, set()).update(gpus)
    return {
        h: [g for g in range(int(spec.get("gpus", 8))) if g not in taken[h]]
        for h, spec in hosts.items()
    }


def _place(need: int, free: dict[str, list[int]]) -> dict[str, list[int]]:
    """The first host with `need` free GPUs (taken from `free`); else the first host's first GPUs
    (overlapping, for validate to report)."""
    for host, gpus in free.items():
        if len(gpus) >= need:
            chosen, free[host] = gpus[:need], gpus[need:]
            return {host: chosen}
    first = next(iter(free))
    return {first: list(range(need))}


def _copies(template: dict[str, Any], role: str, axes: dict[str, Any], count: int) -> dict:
    out = {}
    for i in range(count):
        engine = copy.deepcopy(template)
        for axis in _ENGINE_AXES:
            if axis in axes:
                engine[axis] = axes[axis]
        for axis in _ARGS_AXES:
            if axis in axes:
                engine.setdefault("args", {})[axis] = axes[axis]
        engine.pop("place", None)
        out[f"{role}-{i}"] = engine
    return out


def _ports(engine: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(mapping, key) of each port an engine listens on: its API and its KV side channel."""
    out = [(engine, "port")] if "port" in engine else []
    side = (engine.get("kv") or {}).get("side_channel") or {}
    return out + ([(side, "port")] if "port" in side else [])


def _unique_ports(engines: dict[str, Any], rebuilt: dict[str, Any]) -> None:
    """Move each rebuilt engine's ports up until no other engine on its host uses them."""
    used: dict[str, set[int]] = {}
    for engine in engines.values():
        for host in engine.get("place") or {}:
            used.setdefault(host, set()).update(int(m[k]) for m, k in _ports(engine))
    for engine in rebuilt.values():
        hosts = list(engine["place"])
        for mapping, key in _ports(engine):
            taken = set().union(*(used.get(h, set()) for h in hosts))
            while int(mapping[key]) in taken:
                mapping[key] = int(mapping[key]) + 1
            for h in hosts:
                used.setdefault(h, set()).add(int(mapping[key]))


def _role_names(engines: dict[str, Any], role: str) -> list[str]:
    return [n for n, e in engines.items() if e.get("role") == role]


def _rewire(proxy: dict[str, Any], engines: dict[str, Any], roles: set[str]) -> None:
    """Point the proxy at the new engines of the roles the matrix rebuilt."""
    if roles & {"prefill", "decode"} and proxy.get("routes"):
        proxy["routes"] = [
            {"prefill": _role_names(engines, "prefill"), "decode": _role_names(engines, "decode")}
        ]
    if "combined" in roles:
        proxy["combined"] = _role_names(engines, "combined")


def apply(base: dict[str, Any], combo: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The base topology's data with one combination applied."""
    data = copy.deepcopy(base)
    defaults = data.get("defaults") or {}
    engines: dict[str, Any] = data["engines"]
    rebuilt: dict[str, Any] = {}
    for role, axes in combo.items():
        names = _role_names(engines, role)
        if not names:
            raise UsageError(f"matrix.{role}: the base topology has no {role} engine to copy")
        template = engines[names[0]]
        rebuilt.update(_copies(template, role, axes, int(axes.get("count", len(names)))))
        for name in names:
            del engines[name]
    free = _free(data["hosts"], engines)
    for engine in rebuilt.values():
        engine["place"] = _place(_gpus_of(engine, defaults), free)
    _unique_ports(engines, rebuilt)
    engines.update(rebuilt)
    if data.get("proxy"):
        _rewire(data["proxy"], engines, set(combo))
    return data


def _absolute_config(data: dict[str, Any], base_file: Path) -> None:
    """model.config is relative to the topology file: keep it pointing at the same file."""
    config = (data.get("model") or {}).get("config")
    if config and not Path(config).is_absolute():
        data["model"]["config"] = str((base_file.parent / config).resolve())


def expand(
    base_file: Path, matrix: dict[str, dict[str, list[Any]]], out_dir: Path
) -> list[tuple[Path, str]]:
    """Write one topology file per combination into out_dir; return (file, label) of each.

    The base's bench file (NAME.bench.yaml) is copied beside each, so a candidate's release checks
    its KV capacity against the same shapes."""
    from hgxserve.bench.scenario import bench_file_for

    base = yaml.safe_load(base_file.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = str(base["name"])[: NAME_MAX - 4].rstrip("-")
    bench = bench_file_for(base_file)
    written = []
    for index, combo in enumerate(combinations(matrix)):
        data = apply(base, combo)
        data["name"] = f"{stem}-m{index:02d}"
        data["description"] = f"tune matrix over {base['name']}: {label(combo)}"
        data.pop("baseline", None)
        _absolute_config(data, base_file)
        path = out_dir / f"{data['name']}.yml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        if bench.is_file():
            shutil.copyfile(bench, bench_file_for(path))
        written.append((path, label(combo)))
    return written
