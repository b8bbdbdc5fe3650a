"""Host-side release switching, with systemd replaced by a recording fake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hgxserve.release.store import ReleaseError, ReleaseSpec, Store, UnitKind, UnitSpec
from hgxserve.release.switch import (
    after_ready,
    arm,
    confirm,
    revert,
    rollback_target,
    start_proxy,
    switch,
)


class FakeSystemd:
    def __init__(self, failing: set[str] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.active: set[str] = set()
        self.failing = failing or set()
        self.deadman: int | None = None
        self.deadman_command: list[str] = []
        self.journals: dict[str, str] = {}
        self.restarting: set[str] = set()

    def stop(self, unit: str) -> None:
        self.calls.append(("stop", unit))
        self.active.discard(unit)

    def start(self, unit: str) -> None:
        self.calls.append(("start", unit))
        self.active.add(unit)

    def reset_failed(self, unit: str) -> None:
        pass

    def daemon_reload(self) -> None:
        self.calls.append(("daemon-reload",))

    def state(self, unit: str) -> str:
        if unit in self.failing:
            return "failed"
        return "active" if unit in self.active else "inactive"

    def show(self, unit: str) -> dict[str, str]:
        if unit in self.restarting:  # exited; systemd starts it again after RestartSec=
            return {"ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code"}
        state = self.state(unit)
        result = "exit-code" if state == "failed" else "success"
        return {"ActiveState": state, "Result": result, "NRestarts": "0"}

    def journal(self, unit: str, lines: int = 15, since: float | None = None) -> str:
        return self.journals.get(unit, f"{unit}: simulated crash")

    def arm_deadman(self, seconds: int, command: list[str]) -> None:
        self.deadman = seconds
        self.deadman_command = list(command)

    def disarm_deadman(self) -> None:
        self.deadman = None

    def firewall(self, ruleset: str | None) -> None:
        self.calls.append(("firewall", ruleset or "remove"))


def stage(store: Store, rid: str, units: list[str], *, baseline: bool = False) -> ReleaseSpec:
    """Stage a release of these units, each file naming its release and path."""
    paths = [f"/etc/systemd/system/{u}" for u in units]
    files = {path: f"[Unit]\nDescription={rid} {path}\n" for path in paths}
    return stage_files(store, rid, files, units, baseline=baseline)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "lib"), system_root=str(tmp_path / "sys"))


def installed(store: Store) -> dict[str, str]:
    unit_dir = store.system_root / "etc/systemd/system"
    return {p.name: p.read_text() for p in sorted(unit_dir.glob("*"))} if unit_dir.exists() else {}


def test_first_switch_installs_and_starts_engines_before_proxy(store: Store) -> None:
    stage(store, "r1", ["hgxserve-prefill-0.service", "hgxserve-proxy.service"], baseline=True)
    sd = FakeSystemd()
    assert switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None) == (
        "switched to r1"
    )
    starts = [c[1] for c in sd.calls if c[0] == "start"]
    assert starts == ["hgxserve-prefill-0.service", "hgxserve-proxy.service"]
    assert store.link("current") == "r1" and store.link("baseline") == "r1"
    assert set(installed(store)) == {"hgxserve-prefill-0.service", "hgxserve-proxy.service"}


def test_switch_stops_proxy_first_and_removes_old_units(store: Store) -> None:
    stage(store, "r1", ["hgxserve-combined-0.service", "hgxserve-proxy.service"])
    stage(store, "r2", ["hgxserve-prefill-0.service", "hgxserve-proxy.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.calls.clear()
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    stops = [c[1] for c in sd.calls if c[0] == "stop"]
    assert stops == ["hgxserve-proxy.service", "hgxserve-combined-0.service"]
    assert set(installed(store)) == {"hgxserve-prefill-0.service", "hgxserve-proxy.service"}
    assert "r2" in installed(store)["hgxserve-proxy.service"]
    assert (store.link("current"), store.link("previous")) == ("r2", "r1")


def test_same_release_twice_touches_nothing(store: Store) -> None:
    stage(store, "r1", ["hgxserve-combined-0.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.calls.clear()
    assert "already current" in switch(store, "r1", confirm_within_s=None, systemd=sd)
    assert sd.calls == []


def test_failed_engine_rolls_back_to_old_release(store: Store) -> None:
    stage(store, "r1", ["hgxserve-combined-0.service", "hgxserve-proxy.service"])
    stage(store, "r2", ["hgxserve-decode-0.service", "hgxserve-proxy.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.failing = {"hgxserve-decode-0.service"}
    with pytest.raises(ReleaseError) as err:
        switch(store, "r2", confirm_within_s=60, systemd=sd, log=lambda m: None)
    assert "rolled back to r1" in str(err.value)
    assert "simulated crash" in str(err.value)
    assert store.link("current") == "r1" and store.pending() is None
    assert set(installed(store)) == {"hgxserve-combined-0.service", "hgxserve-proxy.service"}
    assert "r1" in installed(store)["hgxserve-proxy.service"]
    assert {"hgxserve-combined-0.service", "hgxserve-proxy.service"} <= sd.active


def r1_current_r2_staged(store: Store, r2_unit: str = "hgxserve-prefill-0.service") -> FakeSystemd:
    """r1 (a combined engine) staged, switched to and current; r2 (`r2_unit`) staged."""
    stage(store, "r1", ["hgxserve-combined-0.service"])
    stage(store, "r2", [r2_unit])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    return sd


def current_r1_then_r2(store: Store, **r2: Any) -> tuple[FakeSystemd, str]:
    """`r1_current_r2_staged`, then a switch to r2 (`r2` its arguments); the fake systemd, and
    what that switch said."""
    sd = r1_current_r2_staged(store)
    return sd, switch(store, "r2", **{"systemd": sd, "log": lambda m: None, **r2})


def test_pending_switch_is_confirmed_or_reverted(store: Store) -> None:
    sd, _ = current_r1_then_r2(store, confirm_within_s=30)
    pending = store.pending()
    assert pending is not None
    assert sd.deadman == 30 and pending == {
        "id": "r2",
        "previous": "r1",
        "since": pending["since"],
        "deadline": pending["since"] + 30,  # what `hgxserve status` shows
    }
    assert store.link("current") == "r1"  # not confirmed yet
    revert(store, "r2", systemd=sd, log=lambda m: None)
    assert sd.deadman is None and store.pending() is None
    assert set(installed(store)) == {"hgxserve-combined-0.service"}
    switch(store, "r2", confirm_within_s=30, systemd=sd, log=lambda m: None)
    assert confirm(store, "r2", systemd=sd) == "release r2 confirmed"
    assert (store.link("current"), store.link("previous")) == ("r2", "r1")
    with pytest.raises(ReleaseError):
        confirm(store, "r3", systemd=sd)


def test_rollback_targets_and_incomplete_release(store: Store) -> None:
    with pytest.raises(ReleaseError, match="no baseline"):
        rollback_target(store, "baseline")
    spec = stage(store, "r1", ["hgxserve-combined-0.service"])
    (store.release_dir("r1") / "tree/etc/systemd/system/hgxserve-combined-0.service").unlink()
    with pytest.raises(ReleaseError, match="incomplete"):
        switch(store, spec.id, confirm_within_s=None, systemd=FakeSystemd(), log=lambda m: None)
    assert store.link("current") is None


def test_prune_keeps_linked_releases(store: Store) -> None:
    for i in range(8):
        stage(store, f"r{i}", ["hgxserve-combined-0.service"])
    store.set_link("baseline", "r0")
    store.set_link("current", "r1")
    removed = store.prune(keep=3)
    assert "r0" not in removed and "r1" not in removed
    assert len(store.status()["releases"]) == 5


def test_arm_on_a_current_release_is_a_no_op(store: Store) -> None:
    # a re-apply that only restarted a stopped unit leaves nothing pending to arm
    stage(store, "r1", ["hgxserve-combined-0.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert "nothing pending" in arm(store, "r1", 30, systemd=sd) and sd.deadman is None


def test_current_release_with_a_stopped_unit_restarts_only_that_unit(store: Store) -> None:
    stage(store, "r1", ["hgxserve-combined-0.service", "hgxserve-proxy.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.active.discard("hgxserve-proxy.service")  # the proxy crashed or was stopped by hand
    sd.calls.clear()
    msg = switch(store, "r1", confirm_within_s=60, systemd=sd, log=lambda m: None)
    assert msg == "release r1 is current; restarted hgxserve-proxy.service"
    assert sd.calls == [("start", "hgxserve-proxy.service")]
    assert store.pending() is None and store.link("current") == "r1"


def _kind(unit: str) -> UnitKind:
    """A unit's kind from its name: the proxy, a multi-node engine's watcher, else an engine."""
    if "proxy" in unit:
        return "proxy"
    return "watch" if unit.endswith("-watch.service") else "engine"


def stage_files(
    store: Store,
    rid: str,
    files: dict[str, str],
    units: list[str] | list[UnitSpec],
    *,
    baseline: bool = False,
) -> ReleaseSpec:
    """Stage a release with exact file contents (a unit given by its file name alone is of the
    kind that name says)."""
    spec = ReleaseSpec(
        id=rid,
        topology=f"topo-{rid}",
        topology_digest=rid * 4,
        baseline=baseline,
        host="hgx-a",
        units=[u if isinstance(u, UnitSpec) else UnitSpec(u, _kind(u)) for u in units],
        files=dict.fromkeys(files, 0o644),
        health_timeout_s=5,
    )
    for path, text in files.items():
        dest = store.release_dir(rid) / "tree" / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    (store.release_dir(rid) / "release.json").write_text(spec.to_json())
    return spec


UNITS = "/etc/systemd/system"


def test_changing_only_the_proxy_config_restarts_only_the_proxy(store: Store) -> None:
    engine = {f"{UNITS}/hgxserve-combined-0.service": "[Service]\nExecStart=/bin/engine\n"}
    proxy_unit = {f"{UNITS}/hgxserve-proxy.service": "[Service]\nExecStart=/bin/proxy\n"}
    units = ["hgxserve-combined-0.service", "hgxserve-proxy.service"]
    stage_files(store, "r1", {**engine, **proxy_unit, "/etc/hgxserve/proxy.json": "{}"}, units)
    stage_files(store, "r2", {**engine, **proxy_unit, "/etc/hgxserve/proxy.json": "{1}"}, units)
    stage_files(store, "r3", {**engine, **proxy_unit, "/etc/hgxserve/proxy.json": "{1}"}, units)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.calls.clear()
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert [c for c in sd.calls if c[0] in ("stop", "start")] == [
        ("stop", "hgxserve-proxy.service"),
        ("start", "hgxserve-proxy.service"),
    ]
    assert (store.system_root / "etc/hgxserve/proxy.json").read_text() == "{1}"
    sd.calls.clear()
    switch(store, "r3", confirm_within_s=None, systemd=sd, log=lambda m: None)  # same files
    assert [c for c in sd.calls if c[0] in ("stop", "start")] == []
    assert store.link("current") == "r3"


def test_rollback_restarts_only_what_the_failed_release_changed(store: Store) -> None:
    engine = {f"{UNITS}/hgxserve-combined-0.service": "[Service]\nExecStart=/bin/engine\n"}
    units_r1 = ["hgxserve-combined-0.service"]
    units_r2 = ["hgxserve-combined-0.service", "hgxserve-decode-0.service"]
    decode = {f"{UNITS}/hgxserve-decode-0.service": "[Service]\nExecStart=/bin/decode\n"}
    stage_files(store, "r1", engine, units_r1)
    stage_files(store, "r2", {**engine, **decode}, units_r2)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.calls.clear()
    sd.failing = {"hgxserve-decode-0.service"}
    with pytest.raises(ReleaseError, match="rolled back to r1"):
        switch(store, "r2", confirm_within_s=30, systemd=sd, log=lambda m: None)
    moves = [c for c in sd.calls if c[0] in ("stop", "start")]
    assert moves == [("start", "hgxserve-decode-0.service"), ("stop", "hgxserve-decode-0.service")]
    assert set(installed(store)) == {"hgxserve-combined-0.service"}


def test_deadman_waits_for_the_other_hosts_then_counts_from_the_rearm(store: Store) -> None:
    sd, msg = current_r1_then_r2(store, confirm_within_s=20, peers_within_s=2400, log=print)
    assert sd.deadman == 2420 and "2420s" in msg  # the others may take up to 2400 s more
    assert sd.deadman_command[-3:] == ["revert", "r2", "--by-timer"]
    assert "in 20s" in arm(store, "r2", 20, systemd=sd)
    assert sd.deadman == 20  # once every host switched, the gate has confirm_within


def test_a_host_that_reverted_on_its_own_is_named(store: Store) -> None:
    sd, _ = current_r1_then_r2(store, confirm_within_s=5)
    revert(store, "r2", systemd=sd, log=lambda m: None, by_timer=True)  # the timer fired
    with pytest.raises(ReleaseError, match="REVERTED ON ITS OWN.*dead-man timer.*back|r1"):
        arm(store, "r2", 5, systemd=sd)
    with pytest.raises(ReleaseError, match="REVERTED ON ITS OWN"):
        confirm(store, "r2", systemd=sd)
    assert store.link("current") == "r1"
    # a later switch to the same release forgets the old own revert
    switch(store, "r2", confirm_within_s=5, systemd=sd, log=lambda m: None)
    revert(store, "r2", systemd=sd, log=lambda m: None)  # the gate failed: not on its own
    with pytest.raises(ReleaseError, match="no pending switch") as err:
        confirm(store, "r2", systemd=sd)
    assert "ON ITS OWN" not in str(err.value)


def test_health_wait_prints_engine_progress_and_names_the_late_unit(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hgxserve.release.switch as sw

    monkeypatch.setattr(sw, "JOURNAL_EVERY_S", 0.0)
    stage(store, "r1", ["hgxserve-decode-0.service"])
    spec = store.load("r1")
    spec.units[0].health_url = "http://127.0.0.1:9/health"  # nothing listens: never healthy
    spec.units[0].start_timeout_s = 1
    (store.release_dir("r1") / "release.json").write_text(spec.to_json())
    sd = FakeSystemd()
    sd.journals["hgxserve-decode-0.service"] = (
        "Loading safetensors checkpoint shards:  25% Completed | 12/48 [00:03<00:09]\r"
        "Loading safetensors checkpoint shards:  50% Completed | 24/48 [00:06<00:06]"
    )
    said: list[str] = []
    with pytest.raises(ReleaseError, match="did not become healthy in time") as err:
        switch(store, "r1", confirm_within_s=None, systemd=sd, log=said.append)
    assert "last seen: loading weights 50% (24/48 shards)" in str(err.value)
    assert any("hgxserve-decode-0.service: loading weights 50%" in line for line in said)


def test_a_failed_switch_names_the_diagnosed_cause_first(store: Store) -> None:
    sd = r1_current_r2_staged(store, "hgxserve-decode-0.service")
    sd.failing = {"hgxserve-decode-0.service"}
    sd.journals["hgxserve-decode-0.service"] = (
        "Loading weights took 25.31 seconds\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    with pytest.raises(ReleaseError) as err:
        switch(store, "r2", confirm_within_s=60, systemd=sd, log=lambda m: None)
    message = str(err.value)
    cause = message.index("CAUSE hgxserve-decode-0.service [cuda-oom]")
    assert cause < message.index("is failed while starting") < message.index("last log lines")
    assert "lower gpu_memory_utilization" in message


def test_deferred_proxy_starts_only_when_asked(store: Store) -> None:
    stage(store, "r1", ["hgxserve-combined-0.service", "hgxserve-proxy.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=30, defer_proxy=True, systemd=sd, log=lambda m: None)
    assert [c[1] for c in sd.calls if c[0] == "start"] == ["hgxserve-combined-0.service"]
    said: list[str] = []
    assert start_proxy(store, "r1", systemd=sd, log=said.append) == "release r1: proxy started"
    assert [c[1] for c in sd.calls if c[0] == "start"][-1] == "hgxserve-proxy.service"
    assert "no proxy to start" in start_proxy(store, "r1", systemd=sd, log=said.append)
    with pytest.raises(ReleaseError, match="not the one switched to"):
        start_proxy(store, "r2", systemd=sd)


def test_after_ready_reports_warm_up_and_jit_after_ready() -> None:
    journal = "\n".join(
        [
            "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%| 10/10",
            "torch.compile takes 12.00 s in total",  # before ready: not reported
            "INFO:     Application startup complete.",
            "http://127.0.0.1:8100/health answers 200",
            "hgxserve warm-up: 16x8x4 completions (topology): 4/4 answered in 0.21 s",
            "[TileLang:tilelang.jit.kernel:INFO]: TileLang begins to compile kernel `main`",
            "hgxserve warm-up: 240x16x1 completions (topology): 1/1 answered in 9.02 s",
        ]
    )
    lines = after_ready(journal)
    assert lines[:2] == [
        "hgxserve warm-up: 16x8x4 completions (topology): 4/4 answered in 0.21 s",
        "hgxserve warm-up: 240x16x1 completions (topology): 1/1 answered in 9.02 s",
    ]
    assert lines[2].startswith("JIT/compile after ready: 1 line(s) (tilelang), first: [TileLang")
    assert after_ready("INFO:     Application startup complete.\n")[-1].endswith("none")
    assert after_ready("still loading\n") == []


def test_an_engine_restarting_with_a_known_cause_fails_at_once(store: Store) -> None:
    sd = r1_current_r2_staged(store, "hgxserve-decode-0.service")
    sd.restarting = {"hgxserve-decode-0.service"}
    sd.journals["hgxserve-decode-0.service"] = "RuntimeError: Error 802: system not yet initialized"
    with pytest.raises(ReleaseError) as err:
        switch(store, "r2", confirm_within_s=60, systemd=sd, log=lambda m: None)
    assert "did not become healthy in time" not in str(err.value)  # not waited out
    assert "CAUSE hgxserve-decode-0.service [cuda-802]" in str(err.value)
    assert "failed while starting (result exit-code; systemd would restart it)" in str(err.value)


def test_watchers_start_after_their_engines_and_stop_before_them(store: Store) -> None:
    """A multi-node engine's watcher never sees its engine starting or stopping (it would take
    that for a death and restart it)."""
    units = [
        "hgxserve-decode-0.service",
        "hgxserve-decode-0-watch.service",
        "hgxserve-proxy.service",
    ]
    stage(store, "r1", units)
    stage(store, "r2", ["hgxserve-combined-0.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert [c[1] for c in sd.calls if c[0] == "start"] == units
    sd.calls.clear()
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert [c[1] for c in sd.calls if c[0] == "stop"] == list(reversed(units))


def test_a_watcher_is_restarted_with_its_engine_even_when_its_own_files_did_not_change(
    store: Store,
) -> None:
    engine, watch = "hgxserve-decode-0.service", "hgxserve-decode-0-watch.service"
    old = {f"{UNITS}/{engine}": "[Service]\nExecStart=/bin/a\n", f"{UNITS}/{watch}": "w\n"}
    new = {**old, f"{UNITS}/{engine}": "[Service]\nExecStart=/bin/b\n"}
    stage_files(store, "r1", old, [engine, watch])
    stage_files(store, "r2", new, [engine, watch])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.calls.clear()
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert [c for c in sd.calls if c[0] in ("stop", "start")] == [
        ("stop", watch), ("stop", engine), ("start", engine), ("start", watch),
    ]  # fmt: skip
    sd.calls.clear()
    stage_files(store, "r3", {**new, "/etc/hgxserve/proxy.json": "{}"}, [engine, watch])
    switch(store, "r3", confirm_within_s=None, systemd=sd, log=lambda m: None)
    # the engine kept: its watcher restarts only for its own config (here: another file changed)
    assert ("stop", engine) not in sd.calls
