"""Host-side release switching, with systemd replaced by a recording fake."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.release.store import ReleaseError, ReleaseSpec, Store, UnitSpec
from hgxserve.release.switch import confirm, revert, rollback_target, switch


class FakeSystemd:
    def __init__(self, failing: set[str] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.active: set[str] = set()
        self.failing = failing or set()
        self.deadman: int | None = None

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

    def journal(self, unit: str, lines: int = 15) -> str:
        return f"{unit}: simulated crash"

    def arm_deadman(self, seconds: int, command: list[str]) -> None:
        self.deadman = seconds

    def disarm_deadman(self) -> None:
        self.deadman = None


def stage(store: Store, rid: str, units: list[str], *, baseline: bool = False) -> ReleaseSpec:
    files = {f"/etc/systemd/system/{u}": 0o644 for u in units}
    spec = ReleaseSpec(
        id=rid,
        topology=f"topo-{rid}",
        topology_digest=rid * 4,
        baseline=baseline,
        host="hgx-a",
        units=[UnitSpec(u, "proxy" if "proxy" in u else "engine") for u in units],
        files=files,
        health_timeout_s=5,
    )
    tree = store.release_dir(rid) / "tree"
    for path in files:
        dest = tree / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f"[Unit]\nDescription={rid} {path}\n")
    (store.release_dir(rid) / "release.json").write_text(spec.to_json())
    return spec


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


def test_pending_switch_is_confirmed_or_reverted(store: Store) -> None:
    stage(store, "r1", ["hgxserve-combined-0.service"])
    stage(store, "r2", ["hgxserve-prefill-0.service"])
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=lambda m: None)
    switch(store, "r2", confirm_within_s=30, systemd=sd, log=lambda m: None)
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


def stage_files(store: Store, rid: str, files: dict[str, str], units: list[str]) -> None:
    """Stage a release with exact file contents (units are named by their file names)."""
    spec = ReleaseSpec(
        id=rid,
        topology=f"topo-{rid}",
        topology_digest=rid * 4,
        baseline=False,
        host="hgx-a",
        units=[UnitSpec(u, "proxy" if "proxy" in u else "engine") for u in units],
        files=dict.fromkeys(files, 0o644),
        health_timeout_s=5,
    )
    for path, text in files.items():
        dest = store.release_dir(rid) / "tree" / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    (store.release_dir(rid) / "release.json").write_text(spec.to_json())


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
