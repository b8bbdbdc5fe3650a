"""The host-side release store: read releases, install their trees, move the links."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hgxserve.base.digests import tree_digest
from hgxserve.base.errors import HgxserveError
from hgxserve.base.paths import RELEASE_ROOT

LINKS = ("current", "previous", "baseline")
UnitKind = Literal["engine", "worker", "watch", "proxy"]
# Release ids are the first 12 hex digits of the release digest (plan.py); anything that could
# name another directory (`..`, `/`, a newline) is refused before it is used in a path.
_RELEASE_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")


def check_release_id(release_id: object) -> str:
    """`release_id` if it is a plain release name, else ReleaseError.

    >>> check_release_id("3f1c9a2b7d10")
    '3f1c9a2b7d10'
    """
    if not isinstance(release_id, str) or not _RELEASE_ID.match(release_id):
        raise ReleaseError(f"not a release id: {str(release_id)[:80]!r}")
    return release_id


def _check_file_path(path: str) -> str:
    parts = path.split("/")
    if (
        not path.startswith("/")
        or any(p in (".", "..") for p in parts[1:])
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path)
    ):
        raise ReleaseError(f"release file path {path[:120]!r} is not a plain absolute path")
    return path


@dataclass
class UnitSpec:
    """One unit of a release, in start order."""

    name: str
    kind: UnitKind
    health_url: str | None = None
    gpus: list[int] = field(default_factory=list)
    start_timeout_s: float | None = None  # the engine's TimeoutStartSec= (topology start_timeout_s)
    # an hgxserve proxy that drains, pauses and reloads: its drain bound (limits.drain_timeout_s)
    drain_s: float | None = None


@dataclass
class ReleaseSpec:
    """release.json: everything the host needs to switch to a release without the controller."""

    id: str
    topology: str
    topology_digest: str
    baseline: bool
    host: str
    units: list[UnitSpec]
    files: dict[str, int]  # absolute path on the host -> mode
    health_timeout_s: float | None = None  # `--data health_timeout`: caps every unit's wait
    gate: dict[str, Any] | None = None  # only on the host that runs the topology's gate
    # digest of the files (hgxserve.base.digests.tree_digest): what `hgxserve render` prints
    tree_digest: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ReleaseSpec:
        data = json.loads(text)
        data["units"] = [UnitSpec(**u) for u in data["units"]]
        check_release_id(data.get("id"))
        for path in data.get("files", {}):
            _check_file_path(path)
        return cls(**data)

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    @property
    def gpus(self) -> set[int]:
        return {g for u in self.units for g in u.gpus}


class ReleaseError(HgxserveError):
    """A release operation failed; the message says why and what state the host is in."""


class Store:
    """Releases under one root (default /var/lib/hgxserve); `system_root` prefixes installed
    paths so tests can install into a scratch directory."""

    def __init__(self, root: str = RELEASE_ROOT, system_root: str = "/") -> None:
        self.root = Path(root)
        self.system_root = Path(system_root)

    # -- reading ------------------------------------------------------------------------------
    def release_dir(self, release_id: str) -> Path:
        return self.root / "releases" / check_release_id(release_id)

    def load(self, release_id: str) -> ReleaseSpec:
        path = self.release_dir(release_id) / "release.json"
        try:
            return ReleaseSpec.from_json(path.read_text())
        except FileNotFoundError:
            raise ReleaseError(f"release {release_id} is not staged here ({path})") from None

    def link(self, name: str) -> str | None:
        path = self.root / name
        if not path.is_symlink():
            return None
        return Path(os.readlink(path)).name

    def set_link(self, name: str, release_id: str | None) -> None:
        path = self.root / name
        if release_id is None:
            path.unlink(missing_ok=True)
            return
        tmp = self.root / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path("releases") / check_release_id(release_id))
        tmp.replace(path)  # atomic: readers see the old or the new link, never none

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self.root / name).read_text())
            return data
        except FileNotFoundError:
            return None

    def _write(self, name: str, data: dict[str, Any] | None) -> None:
        """Replace (atomically) or remove one JSON state file under the root."""
        path = self.root / name
        if data is None:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(path)

    def pending(self) -> dict[str, Any] | None:
        return self._read("pending.json")

    def set_pending(self, data: dict[str, Any] | None) -> None:
        self._write("pending.json", data)

    def last_revert(self) -> dict[str, Any] | None:
        """The last revert this host did on its own (its dead-man timer fired), if any."""
        return self._read("reverted.json")

    def set_last_revert(self, data: dict[str, Any] | None) -> None:
        self._write("reverted.json", data)

    # -- what the engines reported (hgxserve.release.kvcap) ------------------------------------
    def observed(self, release_id: str) -> dict[str, dict[str, Any]]:
        """Unit -> what it reported once healthy in this release: start time (unit start to
        healthy and warm, `start_s`), KV capacity (`kv_tokens` per DP rank, `kv_source`), and
        once checked the need, the fit estimate and their ratio (`kv_need_tokens`,
        `kv_fit_ratio`, `kv_verdict`, `kv_message`). Empty when nothing was recorded."""
        path = self.release_dir(release_id) / "observed.json"
        try:
            data: dict[str, dict[str, Any]] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return data

    def note_observed(
        self, release_id: str, unit: str, fields: dict[str, Any], replace: bool = False
    ) -> None:
        """Merge `fields` into `unit`'s entry of the release's record, or with `replace` make
        them the whole entry (a unit that started again); the file is replaced atomically."""
        data = self.observed(release_id)
        data[unit] = {**({} if replace else data.get(unit, {})), **fields}
        path = self.release_dir(release_id) / "observed.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)

    def carry_observed(self, old_id: str, new_id: str, units: frozenset[str]) -> None:
        """Units that keep running across a switch keep what they reported when they started."""
        old = self.observed(old_id)
        for unit in sorted(units & set(old)):
            self.note_observed(new_id, unit, {**old[unit], "kept_from": old_id}, replace=True)

    def status(self) -> dict[str, Any]:
        """What ReleaseState reports: links, pending switch and staged releases, and what the
        running release's engines reported (`observed`)."""
        releases = sorted(p.name for p in (self.root / "releases").glob("*") if p.is_dir())
        pending = self.pending()
        running = (pending or {}).get("id") or self.link("current")
        return {
            **{name: self.link(name) for name in LINKS},
            "pending": pending,
            "releases": releases,
            "observed": self.observed(running) if running else {},
        }

    # -- installing ---------------------------------------------------------------------------
    def _target(self, path: str) -> Path:
        return self.system_root / path.lstrip("/")

    def installed(self, path: str) -> Path:
        """Where the release file `path` is installed (under `system_root`)."""
        return self._target(_check_file_path(path))

    def install(self, spec: ReleaseSpec, old: ReleaseSpec | None) -> None:
        """Make the installed files exactly those of `spec` (removing the old release's others)."""
        tree = self.release_dir(spec.id) / "tree"
        for path, mode in sorted(spec.files.items()):
            src = tree / path.lstrip("/")
            if not src.is_file():
                raise ReleaseError(f"release {spec.id} is incomplete: {src} is missing")
            dest = self._target(path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.hgxserve-tmp")
            shutil.copyfile(src, tmp)
            os.chmod(tmp, mode)
            tmp.replace(dest)
        if old is not None:
            for path in sorted(set(old.files) - set(spec.files)):
                self._target(path).unlink(missing_ok=True)

    def verify_tree(self, spec: ReleaseSpec) -> None:
        """Every file of the release is staged (the controller pushed all of them)."""
        tree = self.release_dir(spec.id) / "tree"
        missing = [p for p in spec.files if not (tree / p.lstrip("/")).is_file()]
        if missing:
            raise ReleaseError(f"release {spec.id} is incomplete, missing: {', '.join(missing)}")
        if spec.tree_digest is not None and self.tree_digest(spec) != spec.tree_digest:
            raise ReleaseError(
                f"release {spec.id}: the staged files do not match the rendered tree "
                f"{spec.tree_digest[:12]} (changed on the host since they were staged)"
            )

    def tree_digest(self, spec: ReleaseSpec) -> str:
        """The digest of the release's staged files, as `hgxserve render` computes it."""
        tree = self.release_dir(spec.id) / "tree"
        return tree_digest(
            {p: ((tree / p.lstrip("/")).read_bytes(), mode) for p, mode in spec.files.items()}
        )

    def prune(self, keep: int = 5) -> list[str]:
        """Delete old releases, never one a link or the pending switch points to."""
        pinned = {self.link(n) for n in LINKS}
        pending = self.pending() or {}
        pinned |= {pending.get("id"), pending.get("previous")}
        dirs = sorted(
            (p for p in (self.root / "releases").glob("*") if p.is_dir()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        removed = []
        for path in dirs[keep:]:
            if path.name not in pinned:
                shutil.rmtree(path)
                removed.append(path.name)
        return removed


def now() -> float:
    return time.time()
