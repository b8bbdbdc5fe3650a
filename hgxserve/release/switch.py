"""Switch a host between releases: stop old units (proxy first), wait for the GPUs to be
released, install the new tree, start engines then proxy, wait for health, and roll back to
the old release on any failure. A switch stays `pending` until the controller confirms it; a
dead-man timer reverts it if no confirmation comes (the controller died or lost the host).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from hgxserve.paths import UNIT_DIR
from hgxserve.release.store import ReleaseError, ReleaseSpec, Store

DEADMAN_UNIT = "hgxserve-release-deadman"
Log = Callable[[str], None]


def _agent() -> str:
    return str(Path(sys.executable).parent / "hgxserve")


class Systemd:
    """The few systemctl/journalctl calls a switch needs."""

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(args, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise ReleaseError(f"{' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
        return proc

    def stop(self, unit: str) -> None:
        self.run("systemctl", "stop", unit, check=False)

    def start(self, unit: str) -> None:
        # Blocking: returns once ExecStartPre= ran and the main process is forked (or the start
        # failed), so an `is-active` right after never sees a start job that is still queued.
        # Failures are read from the unit's state and journal by the health wait.
        self.run("systemctl", "start", unit, check=False)

    def reset_failed(self, unit: str) -> None:
        self.run("systemctl", "reset-failed", unit, check=False)

    def daemon_reload(self) -> None:
        self.run("systemctl", "daemon-reload")

    def state(self, unit: str) -> str:
        return self.run("systemctl", "is-active", unit, check=False).stdout.strip()

    def journal(self, unit: str, lines: int = 15) -> str:
        proc = self.run(
            "journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat", check=False
        )
        return proc.stdout.strip()

    def arm_deadman(self, seconds: int, command: Sequence[str]) -> None:
        self.disarm_deadman()
        self.run(
            "systemd-run",
            f"--unit={DEADMAN_UNIT}",
            f"--on-active={seconds}s",
            "--timer-property=AccuracySec=1s",
            *command,
        )

    def disarm_deadman(self) -> None:
        self.run("systemctl", "stop", f"{DEADMAN_UNIT}.timer", check=False)
        self.run("systemctl", "reset-failed", f"{DEADMAN_UNIT}.service", check=False)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_gpus_free(gpus: set[int], timeout_s: float, log: Log) -> None:
    if not gpus:
        return
    listed = ",".join(str(g) for g in sorted(gpus))
    log(f"waiting for GPUs {listed} to hold no memory (up to {timeout_s:.0f}s)")
    proc = subprocess.run(
        [_agent(), "gpus", "wait-free", "--gpus", listed, "--timeout", str(int(timeout_s))],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ReleaseError((proc.stderr or proc.stdout).strip() or "GPUs still in use")


def stop_units(
    spec: ReleaseSpec, systemd: Systemd, log: Log, keep: frozenset[str] = frozenset()
) -> None:
    """Stop in reverse start order: the proxy first, so no request lands on a stopping engine.
    Units in `keep` run the same in the next release and stay up."""
    for unit in reversed(spec.units):
        if unit.name in keep:
            log(f"keeping {unit.name} running (unchanged)")
            continue
        log(f"stopping {unit.name}")
        systemd.stop(unit.name)


def start_units(
    spec: ReleaseSpec,
    systemd: Systemd,
    log: Log,
    timeout_s: float,
    keep: frozenset[str] = frozenset(),
) -> None:
    """Start engines (then wait for their health) and then the proxy, in release order.
    Units in `keep` are already running; they are only health-checked."""
    deadline = time.monotonic() + timeout_s
    engines = [u for u in spec.units if u.kind != "proxy"]
    proxies = [u for u in spec.units if u.kind == "proxy"]
    for group in (engines, proxies):
        for unit in group:
            if unit.name in keep:
                continue
            systemd.reset_failed(unit.name)
            log(f"starting {unit.name}")
            systemd.start(unit.name)
        _wait_healthy(group, systemd, log, deadline)


def unchanged_units(store: Store, old: ReleaseSpec | None, new: ReleaseSpec) -> frozenset[str]:
    """Units that run exactly the same in both releases and can stay up across the switch:
    same unit file bytes, same spec (GPUs, health), and for the proxy also the same other files
    (its proxy.json). Changing only the proxy's routing then restarts only the proxy."""
    if old is None:
        return frozenset()

    def content(spec: ReleaseSpec, path: str) -> bytes | None:
        if path not in spec.files:
            return None
        file = store.release_dir(spec.id) / "tree" / path.lstrip("/")
        return file.read_bytes() if file.is_file() else None

    others_same = all(
        content(old, path) == content(new, path)
        for path in set(old.files) | set(new.files)
        if not path.startswith(f"{UNIT_DIR}/")
    )
    old_units = {u.name: u for u in old.units}
    keep = set()
    for unit in new.units:
        path = f"{UNIT_DIR}/{unit.name}"
        text = content(new, path)
        if old_units.get(unit.name) != unit or text is None or content(old, path) != text:
            continue
        if unit.kind == "proxy" and not others_same:
            continue
        keep.add(unit.name)
    return frozenset(keep)


def _transition(
    store: Store,
    old: ReleaseSpec | None,
    new: ReleaseSpec,
    systemd: Systemd,
    log: Log,
    gpu_timeout_s: float,
) -> None:
    """Go from `old` to `new`: stop what changes, wait for its GPUs, install, start."""
    keep = unchanged_units(store, old, new)
    if old is not None:
        stop_units(old, systemd, log, keep)
    moving = {g for spec in (old, new) if spec for u in spec.units if u.name not in keep
              for g in u.gpus}  # fmt: skip
    wait_gpus_free(moving, gpu_timeout_s, log)
    store.install(new, old)
    systemd.daemon_reload()
    start_units(new, systemd, log, new.health_timeout_s, keep)


def _wait_healthy(units: list, systemd: Systemd, log: Log, deadline: float) -> None:
    waiting = {u.name: u for u in units}
    started = time.monotonic()
    while waiting:
        for name, unit in list(waiting.items()):
            state = systemd.state(name)
            if state in ("failed", "inactive"):
                tail = systemd.journal(name)
                raise ReleaseError(f"{name} is {state} while starting; last log lines:\n{tail}")
            if state == "active" and (unit.health_url is None or _healthy(unit.health_url)):
                log(f"{name} is healthy after {time.monotonic() - started:.1f}s")
                del waiting[name]
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(waiting)
            raise ReleaseError(f"{names} did not become healthy in time")
        time.sleep(0.5)


def _activate(
    store: Store,
    new: ReleaseSpec,
    old: ReleaseSpec | None,
    systemd: Systemd,
    log: Log,
    gpu_timeout_s: float,
) -> None:
    store.verify_tree(new)
    _transition(store, old, new, systemd, log, gpu_timeout_s)


def switch(
    store: Store,
    release_id: str,
    *,
    confirm_within_s: int | None,
    systemd: Systemd | None = None,
    gpu_timeout_s: float = 300.0,
    log: Log = print,
) -> str:
    """Switch to `release_id`; on failure go back to the old release and raise ReleaseError.

    With `confirm_within_s` the switch is left pending and a timer reverts it unless
    `confirm()` is called in time; without it the switch is confirmed at once.
    """
    systemd = systemd or Systemd()
    new = store.load(release_id)
    current_id = store.link("current")
    pending = store.pending()
    if pending:
        if pending["id"] == release_id:
            return f"release {release_id} is already switched, waiting for confirmation"
        current_id = pending["id"]  # a pending switch is what is running now
    if current_id == release_id:
        return _restart_stopped(new, systemd, log)
    old = store.load(current_id) if current_id else None
    previous_id = pending["previous"] if pending else current_id
    log(f"switching {new.host} from {current_id or 'nothing'} to {release_id} ({new.topology})")
    try:
        _activate(store, new, old, systemd, log, gpu_timeout_s)
    except ReleaseError as exc:
        reason = str(exc)
        log(f"switch to {release_id} failed: {reason}")
        back = store.load(previous_id) if previous_id else None
        _rollback_to(store, back, new, systemd, log, gpu_timeout_s)
        store.set_pending(None)
        raise ReleaseError(
            f"switch to {release_id} failed and was rolled back to "
            f"{previous_id or 'nothing'}: {reason}"
        ) from None
    if confirm_within_s:
        since = time.time()
        store.set_pending(
            {
                "id": release_id,
                "previous": previous_id,
                "since": since,
                "deadline": since + confirm_within_s,  # when the dead-man timer reverts it
            }
        )
        systemd.arm_deadman(confirm_within_s, [_agent(), "release", "revert", release_id])
        return f"switched to {release_id}; revert in {confirm_within_s}s unless confirmed"
    _commit(store, new, previous_id)
    return f"switched to {release_id}"


def _restart_stopped(spec: ReleaseSpec, systemd: Systemd, log: Log) -> str:
    """The release is current but some of its units stopped or crashed: start just those."""
    stopped = [u for u in spec.units if systemd.state(u.name) != "active"]
    if not stopped:
        return f"release {spec.id} is already current"
    names = ", ".join(u.name for u in stopped)
    log(f"release {spec.id} is current but {names} not running; starting them")
    start_units(
        ReleaseSpec(spec.id, spec.topology, "", False, spec.host, stopped, {}),
        systemd,
        log,
        spec.health_timeout_s,
    )
    return f"release {spec.id} is current; restarted {names}"


def _rollback_to(
    store: Store,
    back: ReleaseSpec | None,
    failed: ReleaseSpec,
    systemd: Systemd,
    log: Log,
    gpu_timeout_s: float,
) -> None:
    if back is None:
        stop_units(failed, systemd, log)
        store.install(ReleaseSpec("none", "", "", False, failed.host, [], {}), failed)
        systemd.daemon_reload()
        return
    try:
        _transition(store, failed, back, systemd, log, gpu_timeout_s)
    except ReleaseError as exc:
        raise ReleaseError(f"rollback to {back.id} failed too: {exc}") from None
    log(f"back on {back.id}")


def _commit(store: Store, spec: ReleaseSpec, previous_id: str | None) -> None:
    if previous_id and previous_id != spec.id:
        store.set_link("previous", previous_id)
    store.set_link("current", spec.id)
    if spec.baseline:
        store.set_link("baseline", spec.id)
    store.set_pending(None)


def confirm(store: Store, release_id: str, systemd: Systemd | None = None) -> str:
    """Make a pending switch current (the topology-wide gate passed)."""
    systemd = systemd or Systemd()
    pending = store.pending()
    if not pending or pending["id"] != release_id:
        if store.link("current") == release_id:
            return f"release {release_id} is already current"
        raise ReleaseError(f"no pending switch to {release_id} (it may have been reverted)")
    systemd.disarm_deadman()
    _commit(store, store.load(release_id), pending.get("previous"))
    return f"release {release_id} confirmed"


def revert(
    store: Store,
    release_id: str,
    *,
    systemd: Systemd | None = None,
    gpu_timeout_s: float = 300.0,
    log: Log = print,
) -> str:
    """Undo a pending switch to `release_id` (gate failed, or no confirmation in time)."""
    systemd = systemd or Systemd()
    pending = store.pending()
    if not pending or pending["id"] != release_id:
        return f"nothing to revert: no pending switch to {release_id}"
    systemd.disarm_deadman()
    failed = store.load(release_id)
    previous_id = pending.get("previous")
    back = store.load(previous_id) if previous_id else None
    log(f"reverting {release_id}, back to {previous_id or 'nothing'}")
    try:
        _rollback_to(store, back, failed, systemd, log, gpu_timeout_s)
    finally:
        store.set_pending(None)
    return f"reverted {release_id}; {previous_id or 'nothing'} is running"


def rollback_target(store: Store, to: str) -> str:
    """The release id `previous`, `baseline` or an explicit id names on this host."""
    if to in ("previous", "baseline"):
        target = store.link(to)
        if target is None:
            raise ReleaseError(f"this host has no {to} release to go back to")
        return target
    store.load(to)
    return to


def reconcile(
    store: Store,
    *,
    systemd: Systemd | None = None,
    gpu_timeout_s: float = 300.0,
    log: Log = print,
) -> str:
    """At boot: undo a switch that was never confirmed, make the installed files exactly those
    of the confirmed release, and start its units (without waiting: engines take minutes)."""
    systemd = systemd or Systemd()
    pending = store.pending()
    if pending:
        return revert(store, pending["id"], systemd=systemd, gpu_timeout_s=gpu_timeout_s, log=log)
    current_id = store.link("current")
    spec = store.load(current_id) if current_id else None
    known: dict[str, int] = {}
    for release_id in store.status()["releases"]:
        with_files = store.load(release_id)
        known.update(with_files.files)
    stray = ReleaseSpec("stray", "", "", False, "", [], known)
    empty = ReleaseSpec("none", "", "", False, "", [], {})
    store.install(spec or empty, stray)
    systemd.daemon_reload()
    if spec is None:
        return "no confirmed release on this host; nothing to start"
    for unit in spec.units:
        log(f"starting {unit.name}")
        systemd.reset_failed(unit.name)
        systemd.start(unit.name)
    return f"release {spec.id} ({spec.topology}) installed and started"
