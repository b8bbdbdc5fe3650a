"""Switch a host between releases: pause and drain the hgxserve proxy
(hgxserve.release.proxydrain), stop old units (proxy first, unless it only pauses), wait for
the GPUs to be released, install the new tree, start engines then proxy (a paused or
reconfigured one is reloaded), wait for health, and roll back to the old release on any
failure. A switch stays `pending` until the controller confirms it; a dead-man timer reverts
it if no confirmation comes (the controller died or lost the host).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hgxserve.base.defaults import GPU_FREE_TIMEOUT_S, schema_default
from hgxserve.base.paths import FIREWALL_FILE, FIREWALL_TABLE, NFT, UNIT_DIR
from hgxserve.caches.logscan import scan
from hgxserve.parsers.outputs import diagnose_errors
from hgxserve.release.kvcap import observation, observed_line, read_capacity
from hgxserve.release.progress import phase
from hgxserve.release.proxydrain import drains, pause, proxy_plan
from hgxserve.release.store import ReleaseError, ReleaseSpec, Store, UnitSpec

DEADMAN_UNIT = "hgxserve-release-deadman"
PROGRESS_EVERY_S = 30.0  # repeat an engine's unchanged start phase this often
JOURNAL_EVERY_S = 3.0  # read the starting engines' journals this often
JOURNAL_LINES = 40
DIAGNOSE_LINES = 2000  # journal lines searched for a known failure's signature
GPU_TIMEOUT_S = GPU_FREE_TIMEOUT_S  # waiting for the old units' GPUs to hold no memory
# A unit still `inactive` this long after its (non-blocking) start was queued never started.
START_GRACE_S = 30.0
# `nft -f` of a few dozen rules takes milliseconds; 30 s bounds a hung netlink socket.
NFT_TIMEOUT_S = 30.0
Log = Callable[[str], None]
Observed = dict[str, dict[str, Any]]  # unit -> its start time and KV capacity (kvcap.observation)


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
        # Not blocking: an engine unit's start job lasts until its ExecStartPost= saw /health
        # (TimeoutStartSec= bounds that), minutes on real GPUs; the health wait follows every
        # starting unit at once, reading state, result and journal.
        self.run("systemctl", "start", "--no-block", unit, check=False)

    def reload(self, unit: str) -> None:
        self.run("systemctl", "reload", unit)

    def signal(self, unit: str, signal: str) -> None:
        self.run("systemctl", "kill", "--kill-whom=main", "-s", signal, unit)

    def reset_failed(self, unit: str) -> None:
        self.run("systemctl", "reset-failed", unit, check=False)

    def daemon_reload(self) -> None:
        self.run("systemctl", "daemon-reload")

    def state(self, unit: str) -> str:
        return self.run("systemctl", "is-active", unit, check=False).stdout.strip()

    def show(self, unit: str) -> dict[str, str]:
        """ActiveState, SubState, Result, NRestarts and ExecMainStatus of `unit`."""
        proc = self.run(
            "systemctl", "show", unit, "-p", "ActiveState,SubState,Result,NRestarts,ExecMainStatus",
            check=False,
        )  # fmt: skip
        return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 15, since: float | None = None) -> str:
        args = ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"]
        if since is not None:
            args += ["--since", f"@{int(since)}"]
        return self.run(*args, check=False).stdout.strip()

    def firewall(self, ruleset: str | None) -> None:
        """Load the installed ruleset file (`nft -f`: the file declares, deletes and defines
        hgxserve's table in one transaction), or with None remove the table (nothing to do
        where nft is not installed: then no table can exist)."""
        script = None if ruleset else f"table {FIREWALL_TABLE}\ndelete table {FIREWALL_TABLE}\n"
        argv = [NFT, "-f", ruleset or "-"]
        try:
            proc = subprocess.run(
                argv, input=script, capture_output=True, text=True, timeout=NFT_TIMEOUT_S
            )
        except FileNotFoundError:
            if ruleset is None:
                return
            raise ReleaseError(f"{NFT} is not installed: cannot load the firewall") from None
        except subprocess.TimeoutExpired:
            raise ReleaseError(f"{' '.join(argv)} did not finish in {NFT_TIMEOUT_S:g}s") from None
        if proc.returncode != 0:
            raise ReleaseError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")

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


def wait_ready(url: str, timeout_s: float, interval_s: float = 1.0) -> bool:
    """Poll `url` until it answers 200 (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


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


def resume_proxy(unit: UnitSpec, systemd: Systemd, log: Log) -> None:
    """A paused or reconfigured hgxserve proxy: reload it (it reads the installed proxy.json
    and admits again); one that is not running is started."""
    if systemd.state(unit.name) != "active":
        systemd.reset_failed(unit.name)
        log(f"starting {unit.name}")
        systemd.start(unit.name)
        return
    log(f"reloading {unit.name}: it reads the installed proxy.json and admits again")
    systemd.reload(unit.name)


def _engines(spec: ReleaseSpec) -> frozenset[str]:
    return frozenset(u.name for u in spec.units if u.kind != "proxy")


def start_units(
    spec: ReleaseSpec,
    systemd: Systemd,
    log: Log,
    keep: frozenset[str] = frozenset(),
    defer_proxy: bool = False,
) -> Observed:
    """Start engines (then wait for their health and warm-up) and then the proxy, in release
    order; with `defer_proxy` the proxy stays stopped (`start_proxy` later). Units in `keep`
    are already running; they are only health-checked. Returns what each engine that started
    reported once healthy (its start time and KV capacity), for the release's record."""
    engines = [u for u in spec.units if u.kind in ("engine", "worker")]
    # the watchers of multi-node engines start once their engines serve, so a start in progress
    # never looks like an engine that is down (stop_units stops them before the engines)
    watchers = [u for u in spec.units if u.kind == "watch"]
    proxies = [u for u in spec.units if u.kind == "proxy"]
    observed: Observed = {}
    for group in (engines, watchers, [] if defer_proxy else proxies):
        for unit in group:
            if unit.name in keep:
                continue
            systemd.reset_failed(unit.name)
            log(f"starting {unit.name}")
            systemd.start(unit.name)
        seen = _wait_healthy(group, systemd, log, spec.health_timeout_s)
        observed.update({name: entry for name, entry in seen.items() if name not in keep})
    return observed


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
        # the firewall is reloaded in place: a change to it restarts no unit
        if not path.startswith(f"{UNIT_DIR}/") and path != FIREWALL_FILE
    )
    old_units = {u.name: u for u in old.units}
    keep = set()
    for unit in new.units:
        path = f"{UNIT_DIR}/{unit.name}"
        text = content(new, path)
        if old_units.get(unit.name) != unit or text is None or content(old, path) != text:
            continue
        if unit.kind in ("proxy", "watch") and not others_same:
            continue
        keep.add(unit.name)
    engines = {u.name for u in new.units if u.kind in ("engine", "worker")}
    if not engines <= keep:
        # an engine restarts: its watcher must not see that as a death (stopped before the
        # engines, started once they serve)
        keep -= {u.name for u in new.units if u.kind == "watch"}
    return frozenset(keep)


@dataclass(frozen=True)
class _Host:
    """What every step of a switch on this host works with: the release store, systemd, the
    log and how long the old units' GPUs may take to hold no memory."""

    store: Store
    systemd: Systemd
    log: Log
    gpu_timeout_s: float = GPU_TIMEOUT_S


def _transition(
    host: _Host, old: ReleaseSpec | None, new: ReleaseSpec, defer_proxy: bool = False
) -> None:
    """Go from `old` to `new`: pause and drain the proxy when engines behind it stop, stop what
    changes, wait for its GPUs, install, start; a proxy whose change a reload covers (or that
    was only paused) is reloaded, not restarted (hgxserve.release.proxydrain)."""
    store, systemd, log = host.store, host.systemd, host.log
    keep = unchanged_units(store, old, new)
    proxies = proxy_plan(store, old, new, keep)
    for unit in proxies.pause:
        pause(unit, systemd, log)
    staying = keep | proxies.reload
    if old is not None:
        stop_units(old, systemd, log, staying)
    moving = {g for spec in (old, new) if spec for u in spec.units if u.name not in staying
              for g in u.gpus}  # fmt: skip
    wait_gpus_free(moving, host.gpu_timeout_s, log)
    store.install(new, old)
    systemd.daemon_reload()
    apply_firewall(store, new, systemd, log)  # before any unit of `new` starts
    if old is not None and old.id != new.id:
        store.carry_observed(old.id, new.id, keep)
    _record(store, new.id, start_units(new, systemd, log, staying, defer_proxy=True))
    if not defer_proxy:
        # a kept proxy may have been paused by the controller (engines of other hosts moved)
        for unit in new.units:
            if unit.name in proxies.reload or (drains(unit) and unit.name in keep):
                resume_proxy(unit, systemd, log)
        start_units(new, systemd, log, staying | _engines(new))


def apply_firewall(store: Store, spec: ReleaseSpec, systemd: Systemd, log: Log) -> None:
    """Load the release's firewall (its installed FIREWALL_FILE), or remove hgxserve's table
    when the release has none (a topology without rules, or the firewall turned off)."""
    if FIREWALL_FILE in spec.files:
        log(f"loading the host firewall ({FIREWALL_FILE}, table {FIREWALL_TABLE})")
        systemd.firewall(str(store.installed(FIREWALL_FILE)))
    else:
        systemd.firewall(None)


def _record(store: Store, release_id: str, observed: Observed) -> None:
    """Keep each started engine's start time and KV capacity in the release's record."""
    for unit, entry in observed.items():
        try:
            store.note_observed(release_id, unit, entry, replace=True)
        except OSError as exc:  # the record is evidence, never a reason to fail the switch
            print(f"{unit}: could not record its start and KV capacity: {exc}", file=sys.stderr)


def start_timeout(unit: UnitSpec, cap_s: float | None) -> float:
    """Seconds to wait for `unit`: its engine's start timeout (the unit's TimeoutStartSec=),
    capped by `--data health_timeout` when the deploy gives one."""
    limits = [t for t in (unit.start_timeout_s, cap_s) if t]
    return min(limits) if limits else float(schema_default("engine", "start_timeout_s"))


def diagnosis(systemd: Systemd, unit: str, since: float | None) -> list[str]:
    """Known failures in the unit's journal (hgxserve facts diagnose), errors first: one line
    each, `CAUSE <unit> [code]: what it means and the fix (log: the line)`."""
    text = systemd.journal(unit, lines=DIAGNOSE_LINES, since=since)
    return [
        f"{'CAUSE' if d['severity'] == 'error' else 'NOTE'} {unit} [{d['code']}]: "
        f"{d['diagnosis']} (log: {d['line'][:300]})"
        for d in diagnose_errors(text)
    ]


def after_ready(journal: str) -> list[str]:
    """What happened between an engine's ready line and now: its warm-up (ExecStartPost=) and
    the JIT/compile lines it logged after ready (`hgxserve cache scan`): each such line is a
    shape the warm-up (or a baked cache) did not cover, and a user would have waited for it."""
    lines = journal.splitlines()
    ready = [i for i, line in enumerate(lines) if phase([line]) == "ready"]
    if not ready:
        return []
    later = lines[ready[0] + 1 :]
    out = [line.strip() for line in later if line.lstrip().startswith("hgxserve warm-up")]
    hits = scan("\n".join(later))
    if hits:
        sources = ", ".join(sorted({h.source for h in hits}))
        out.append(
            f"JIT/compile after ready: {len(hits)} line(s) ({sources}), first: {hits[0].line}"
        )
    else:
        out.append("JIT/compile after ready: none")
    return out


def _failure(systemd: Systemd, unit: str, since: float, message: str) -> ReleaseError:
    """The error for a unit that failed to start: the diagnosed cause first, then what
    happened and the journal's last lines."""
    cause = diagnosis(systemd, unit, since)
    tail = systemd.journal(unit, since=since)
    head = "".join(line + "\n" for line in cause)
    return ReleaseError(f"{head}{message}; last log lines:\n{tail}")


def _why(info: dict[str, str]) -> str:
    result, status = info.get("Result", ""), info.get("ExecMainStatus", "")
    why = f"result {result}" if result and result != "success" else "stopped"
    return why + (f", exit status {status}" if status not in ("", "0") else "")


def _wait_healthy(
    units: list[UnitSpec], systemd: Systemd, log: Log, cap_s: float | None = None
) -> Observed:
    """Wait until every unit is active and its /health answers 200, printing each engine's
    start phase from its journal (loading weights n%, compiling, capturing CUDA graphs) when
    it changes and every PROGRESS_EVERY_S; fail on the first unit that fails or runs late.
    Returns each engine's start time and the KV capacity it reported once healthy."""
    watch = _StartWatch(systemd, log, time.monotonic(), time.time() - 1)
    watch.deadlines = {u.name: watch.started + start_timeout(u, cap_s) for u in units}
    waiting = {u.name: u for u in units}
    last_read = 0.0
    while waiting:
        now = time.monotonic()
        read_journal = now - last_read >= JOURNAL_EVERY_S
        last_read = now if read_journal else last_read
        for name, unit in list(waiting.items()):
            if watch.healthy(unit, now, read_journal):
                del waiting[name]
        if waiting:
            time.sleep(0.5)
    return watch.observed


@dataclass
class _StartWatch:
    """The health wait over a group of starting units: when each must be healthy, the start
    phase last said of each (and when), the restarts seen."""

    systemd: Systemd
    log: Log
    started: float  # monotonic
    since: float  # wall clock, for the journal
    deadlines: dict[str, float] = field(default_factory=dict)
    said: dict[str, tuple[str, float]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    observed: Observed = field(default_factory=dict)

    def healthy(self, unit: UnitSpec, now: float, read_journal: bool) -> bool:
        """One look at a starting unit: True once it is healthy; raises when it failed or is
        late."""
        name = unit.name
        info = self.systemd.show(name)
        state = info.get("ActiveState", "")
        self._check_started(name, info, now)
        if state != "active" and read_journal:
            self._check_restart(name, info)
        if state == "active" and (unit.health_url is None or _healthy(unit.health_url)):
            self.log(f"{name} is healthy after {now - self.started:.1f}s")
            if unit.health_url is not None:
                self._served(unit, now)
            return True
        if now > self.deadlines[name]:
            last = self.said.get(name, ("", 0.0))[0] or state
            raise _failure(
                self.systemd,
                name,
                self.since,
                f"{name} did not become healthy in time "
                f"({self.deadlines[name] - self.started:.0f}s, last seen: {last})",
            )
        if unit.health_url is not None and read_journal:
            self._say_phase(name, state, now)
        return False

    def _served(self, unit: UnitSpec, now: float) -> None:
        """An engine that just became healthy (and warm): its warm-up and JIT lines, and what
        it reports of itself: the start time and its KV capacity (hgxserve.release.kvcap)."""
        assert unit.health_url is not None
        journal = self.systemd.journal(unit.name, DIAGNOSE_LINES, self.since)
        for line in after_ready(journal):
            self.log(f"{unit.name}: {line}")
        if unit.kind in ("proxy", "watch"):
            return
        entry = observation(now - self.started, read_capacity(unit.health_url, journal))
        self.observed[unit.name] = entry
        self.log(observed_line(unit.name, entry))

    def _check_started(self, name: str, info: dict[str, str], now: float) -> None:
        """Fail when the unit failed, or stopped (or never started) instead of starting."""
        state = info.get("ActiveState", "")
        result = info.get("Result", "success") or "success"
        if state == "failed" or (
            state == "inactive" and (result != "success" or now - self.started > START_GRACE_S)
        ):
            what = f"{name} is {state} while starting ({_why(info)})"
            raise _failure(self.systemd, name, self.since, what)

    def _check_restart(self, name: str, info: dict[str, str]) -> None:
        """A unit that exited and that systemd restarts (Restart=): with a known cause in its
        journal it is not a flake, and starting it again would only fail again."""
        result = info.get("Result", "success") or "success"
        count = int(info.get("NRestarts") or 0)
        if not (result != "success" or count > 0 or info.get("SubState") == "auto-restart"):
            return
        if any(line.startswith("CAUSE") for line in diagnosis(self.systemd, name, self.since)):
            what = f"{name} failed while starting ({_why(info)}; systemd would restart it)"
            raise _failure(self.systemd, name, self.since, what)
        if self.restarts.get(name) != count:
            self.restarts[name] = count
            self.log(f"{name}: exited while starting ({_why(info)}); systemd restarts it")

    def _say_phase(self, name: str, state: str, now: float) -> None:
        """Log the engine's start phase from its journal when it changed or was said long ago."""
        text = self.systemd.journal(name, lines=JOURNAL_LINES, since=self.since)
        current = phase(text.splitlines()) or f"{state}, no engine progress line yet"
        previous, at = self.said.get(name, ("", 0.0))
        if current != previous or now - at >= PROGRESS_EVERY_S:
            self.log(f"{name}: {current} ({now - self.started:.0f}s)")
            self.said[name] = (current, now)


def _activate(
    host: _Host, new: ReleaseSpec, old: ReleaseSpec | None, defer_proxy: bool = False
) -> None:
    host.store.verify_tree(new)
    _transition(host, old, new, defer_proxy)


def switch(  # noqa: PLR0913 - the agent's entry point: store, release and keyword-only options
    store: Store,
    release_id: str,
    *,
    confirm_within_s: int | None,
    peers_within_s: int = 0,
    defer_proxy: bool = False,
    systemd: Systemd | None = None,
    gpu_timeout_s: float = GPU_TIMEOUT_S,
    log: Log = print,
) -> str:
    """Switch to `release_id`; on failure go back to the old release and raise ReleaseError.

    With `confirm_within_s` the switch is left pending and a timer reverts it unless
    `confirm()` is called in time; without it the switch is confirmed at once. The timer first
    runs `peers_within_s + confirm_within_s`: the other hosts of the topology may still be
    starting their engines for up to `peers_within_s` (the controller's bound on the slowest
    host); once every host has switched the controller re-arms it to `confirm_within_s`
    (`arm()`), so a host never reverts on its own while the gate still waits for the others.
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
        return _restart_stopped(store, new, systemd, log)
    old = store.load(current_id) if current_id else None
    previous_id = pending["previous"] if pending else current_id
    log(f"switching {new.host} from {current_id or 'nothing'} to {release_id} ({new.topology})")
    host = _Host(store, systemd, log, gpu_timeout_s)
    try:
        _activate(host, new, old, defer_proxy)
    except ReleaseError as exc:
        reason = str(exc)
        log(f"switch to {release_id} failed: {reason}")
        back = store.load(previous_id) if previous_id else None
        _rollback_to(host, back, new)
        store.set_pending(None)
        raise ReleaseError(
            f"switch to {release_id} failed and was rolled back to "
            f"{previous_id or 'nothing'}: {reason}"
        ) from None
    if confirm_within_s:
        window = confirm_within_s + max(0, peers_within_s)
        store.set_last_revert(None)  # an earlier run's own revert no longer explains anything
        since = time.time()
        store.set_pending(
            {
                "id": release_id,
                "previous": previous_id,
                "since": since,
                "deadline": since + window,  # when the dead-man timer reverts it
            }
        )
        systemd.arm_deadman(window, _deadman_command(release_id))
        return (
            f"switched to {release_id}; reverts on its own in {window}s unless confirmed "
            f"({confirm_within_s}s once every host has switched)"
        )
    _commit(store, new, previous_id)
    return f"switched to {release_id}"


def start_proxy(
    store: Store, release_id: str, systemd: Systemd | None = None, log: Log = print
) -> str:
    """Start the proxy units of the switched release `release_id` that are not running (the
    switch left them stopped until every host's engines were healthy and warm)."""
    systemd = systemd or Systemd()
    pending = store.pending()
    running = pending["id"] if pending else store.link("current")
    if running != release_id:
        raise ReleaseError(f"release {release_id} is not the one switched to here ({running})")
    spec = store.load(release_id)
    # an hgxserve proxy that runs (paused for the switch, or with its new proxy.json not yet
    # read) is reloaded: it admits again without dropping what it holds
    running = [u for u in spec.units if drains(u) and systemd.state(u.name) == "active"]
    stopped = [u for u in spec.units if u.kind == "proxy" and systemd.state(u.name) != "active"]
    if not stopped and not running:
        return f"release {release_id}: no proxy to start here"
    for unit in running:
        log(f"reloading {unit.name} (every engine of the release is healthy and warm)")
        systemd.reload(unit.name)
    for unit in stopped:
        systemd.reset_failed(unit.name)
        log(f"starting {unit.name} (every engine of the release is healthy and warm)")
        systemd.start(unit.name)
    _wait_healthy(running + stopped, systemd, log, spec.health_timeout_s)
    return f"release {release_id}: proxy {'reloaded' if running and not stopped else 'started'}"


def _running(store: Store) -> ReleaseSpec | None:
    """The release that runs here now: a pending switch, else the current one."""
    pending = store.pending()
    running = pending["id"] if pending else store.link("current")
    return store.load(running) if running else None


def moves(store: Store, release_id: str) -> dict[str, Any]:
    """What a switch to `release_id` does here, for the controller before any host switches:
    whether it stops or starts an engine (`engines`), and the drainable proxies running here
    (`proxies`), which the controller pauses when engines of other hosts move."""
    new = store.load(release_id)
    old = _running(store)
    if old is not None and old.id == release_id:
        return {"engines": False, "proxies": [u.name for u in old.units if drains(u)]}
    keep = unchanged_units(store, old, new)
    engines = any(
        u.kind != "proxy" and u.name not in keep for spec in (old, new) if spec for u in spec.units
    )
    proxies = [u.name for u in old.units if drains(u)] if old else []
    return {"engines": engines, "proxies": proxies}


def pause_proxy(store: Store, systemd: Systemd | None = None, log: Log = print) -> str:
    """Pause the running hgxserve proxy here and wait until nothing is in flight (at most its
    drain bound): engines of other hosts are about to stop. The switch's `start-proxy`, or a
    rollback or revert, reloads it (admits again)."""
    systemd = systemd or Systemd()
    running = _running(store)
    units = [u for u in running.units if drains(u)] if running else []
    if not units:
        return "no hgxserve proxy runs here: nothing to pause"
    for unit in units:
        pause(unit, systemd, log)
    return f"paused {', '.join(u.name for u in units)}"


def _restart_stopped(store: Store, spec: ReleaseSpec, systemd: Systemd, log: Log) -> str:
    """The release is current but some of its units stopped or crashed: start just those."""
    stopped = [u for u in spec.units if systemd.state(u.name) != "active"]
    if not stopped:
        return f"release {spec.id} is already current"
    names = ", ".join(u.name for u in stopped)
    log(f"release {spec.id} is current but {names} not running; starting them")
    started = start_units(
        ReleaseSpec(
            spec.id, spec.topology, "", False, spec.host, stopped, {}, spec.health_timeout_s
        ),
        systemd,
        log,
    )
    _record(store, spec.id, started)
    return f"release {spec.id} is current; restarted {names}"


def _rollback_to(host: _Host, back: ReleaseSpec | None, failed: ReleaseSpec) -> None:
    if back is None:
        stop_units(failed, host.systemd, host.log)
        empty = ReleaseSpec("none", "", "", False, failed.host, [], {})
        host.store.install(empty, failed)
        host.systemd.daemon_reload()
        apply_firewall(host.store, empty, host.systemd, host.log)
        return
    try:
        _transition(host, failed, back)
    except ReleaseError as exc:
        raise ReleaseError(f"rollback to {back.id} failed too: {exc}") from None
    host.log(f"back on {back.id}")


def _commit(store: Store, spec: ReleaseSpec, previous_id: str | None) -> None:
    if previous_id and previous_id != spec.id:
        store.set_link("previous", previous_id)
    store.set_link("current", spec.id)
    if spec.baseline:
        store.set_link("baseline", spec.id)
    store.set_pending(None)


def _deadman_command(release_id: str) -> list[str]:
    return [_agent(), "release", "revert", release_id, "--by-timer"]


def _not_pending(store: Store, release_id: str) -> ReleaseError:
    """Why `release_id` is not pending here: named when this host reverted it on its own."""
    last = store.last_revert()
    if last and last.get("id") == release_id:
        at = time.strftime("%H:%M:%S UTC", time.gmtime(float(last.get("at", 0))))
        return ReleaseError(
            f"REVERTED ON ITS OWN: this host's dead-man timer fired at {at} and reverted "
            f"{release_id} to {last.get('previous') or 'nothing'} before the confirmation came "
            "(raise confirm_within if the gate needs longer)"
        )
    return ReleaseError(f"no pending switch to {release_id} (it may have been reverted)")


def arm(store: Store, release_id: str, seconds: int, systemd: Systemd | None = None) -> str:
    """(Re)arm the dead-man timer of the pending switch to `release_id`: revert on its own
    `seconds` from now unless confirmed. The controller calls this once every host switched."""
    systemd = systemd or Systemd()
    pending = store.pending()
    last = store.last_revert()
    if last and last.get("id") == release_id:  # its timer fired (the revert may still run)
        raise _not_pending(store, release_id)
    if not pending and store.link("current") == release_id:
        return f"release {release_id} is current (stopped units restarted): nothing pending"
    if not pending or pending["id"] != release_id:
        raise _not_pending(store, release_id)
    systemd.arm_deadman(seconds, _deadman_command(release_id))
    store.set_pending({**pending, "deadline": time.time() + seconds})
    return f"release {release_id} pending; reverts on its own in {seconds}s unless confirmed"


def confirm(store: Store, release_id: str, systemd: Systemd | None = None) -> str:
    """Make a pending switch current (the topology-wide gate passed)."""
    systemd = systemd or Systemd()
    pending = store.pending()
    if not pending or pending["id"] != release_id:
        if store.link("current") == release_id:
            return f"release {release_id} is already current"
        raise _not_pending(store, release_id)
    systemd.disarm_deadman()
    _commit(store, store.load(release_id), pending.get("previous"))
    return f"release {release_id} confirmed"


def revert(  # noqa: PLR0913 - the agent's entry point: store, release and keyword-only options
    store: Store,
    release_id: str,
    *,
    systemd: Systemd | None = None,
    gpu_timeout_s: float = GPU_TIMEOUT_S,
    log: Log = print,
    by_timer: bool = False,
) -> str:
    """Undo a pending switch to `release_id` (gate failed, or no confirmation in time: then
    `by_timer`, and the host records that it reverted on its own for the controller to name)."""
    systemd = systemd or Systemd()
    pending = store.pending()
    if not pending or pending["id"] != release_id:
        return f"nothing to revert: no pending switch to {release_id}"
    if not by_timer:
        systemd.disarm_deadman()
    failed = store.load(release_id)
    previous_id = pending.get("previous")
    if by_timer:
        store.set_last_revert({"id": release_id, "previous": previous_id, "at": time.time()})
        log(f"dead-man timer: no confirmation for {release_id} in time; reverting on its own")
    back = store.load(previous_id) if previous_id else None
    log(f"reverting {release_id}, back to {previous_id or 'nothing'}")
    try:
        _rollback_to(_Host(store, systemd, log, gpu_timeout_s), back, failed)
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
    gpu_timeout_s: float = GPU_TIMEOUT_S,
    log: Log = print,
) -> str:
    """At boot: undo a switch that was never confirmed, make the installed files exactly those
    of the confirmed release, load its firewall (or remove hgxserve's table) and start its
    units (without waiting: engines take minutes)."""
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
    apply_firewall(store, spec or empty, systemd, log)  # at boot, before any unit starts
    if spec is None:
        return "no confirmed release on this host; nothing to start"
    for unit in spec.units:
        log(f"starting {unit.name}")
        systemd.reset_failed(unit.name)
        systemd.start(unit.name)
    return f"release {spec.id} ({spec.topology}) installed and started"
