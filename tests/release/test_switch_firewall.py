"""The host firewall across switches: loaded from the installed release file before any unit of
the release starts, removed when the release has none, and a change to it alone restarts no
unit (systemd and nft replaced by the recording fake of test_switch)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_switch import FakeSystemd, stage_files

from hgxserve.base.paths import FIREWALL_FILE
from hgxserve.release.store import Store
from hgxserve.release.switch import reconcile, revert, switch

UNITS = "/etc/systemd/system"
ENGINE = {f"{UNITS}/hgxserve-combined-0.service": "[Service]\nExecStart=/bin/engine\n"}
PROXY = {f"{UNITS}/hgxserve-proxy.service": "[Service]\nExecStart=/bin/proxy\n"}
NAMES = ["hgxserve-combined-0.service", "hgxserve-proxy.service"]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "lib"), system_root=str(tmp_path / "sys"))


def _quiet(message: str) -> None:
    pass


def test_the_firewall_is_loaded_before_the_units_start(store: Store) -> None:
    stage_files(store, "r1", {**ENGINE, **PROXY, FIREWALL_FILE: "table inet hgxserve\n"}, NAMES)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=_quiet)
    loaded = str(store.system_root / FIREWALL_FILE.lstrip("/"))
    steps = [c[0] for c in sd.calls if c[0] in ("firewall", "start", "daemon-reload")]
    assert steps == ["daemon-reload", "firewall", "start", "start"]
    assert ("firewall", loaded) in sd.calls
    assert Path(loaded).read_text() == "table inet hgxserve\n"


def test_a_change_to_the_firewall_alone_restarts_nothing(store: Store) -> None:
    stage_files(store, "r1", {**ENGINE, **PROXY, FIREWALL_FILE: "# one\n"}, NAMES)
    stage_files(store, "r2", {**ENGINE, **PROXY, FIREWALL_FILE: "# two\n"}, NAMES)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=_quiet)
    sd.calls.clear()
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=_quiet)
    assert [c for c in sd.calls if c[0] in ("stop", "start")] == []
    assert [c[0] for c in sd.calls if c[0] == "firewall"] == ["firewall"]
    assert (store.system_root / FIREWALL_FILE.lstrip("/")).read_text() == "# two\n"


def test_a_release_without_rules_removes_the_table_and_the_file(store: Store) -> None:
    stage_files(store, "r1", {**ENGINE, **PROXY, FIREWALL_FILE: "# rules\n"}, NAMES)
    stage_files(store, "r2", {**ENGINE, **PROXY}, NAMES)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=_quiet)
    sd.calls.clear()
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=_quiet)
    assert ("firewall", "remove") in sd.calls
    assert not (store.system_root / FIREWALL_FILE.lstrip("/")).exists()


def test_a_revert_loads_the_old_rules_again(store: Store) -> None:
    stage_files(store, "r1", {**ENGINE, **PROXY, FIREWALL_FILE: "# old\n"}, NAMES)
    stage_files(store, "r2", {**ENGINE, **PROXY}, NAMES)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=_quiet)
    switch(store, "r2", confirm_within_s=60, systemd=sd, log=_quiet)
    sd.calls.clear()
    revert(store, "r2", systemd=sd, log=_quiet)
    loaded = str(store.system_root / FIREWALL_FILE.lstrip("/"))
    assert [c for c in sd.calls if c[0] == "firewall"] == [("firewall", loaded)]
    assert Path(loaded).read_text() == "# old\n"


def test_boot_loads_the_confirmed_release_rules_before_its_units(store: Store) -> None:
    stage_files(store, "r1", {**ENGINE, **PROXY, FIREWALL_FILE: "# rules\n"}, NAMES)
    sd = FakeSystemd()
    switch(store, "r1", confirm_within_s=None, systemd=sd, log=_quiet)
    (store.system_root / FIREWALL_FILE.lstrip("/")).unlink()  # e.g. a wiped /etc
    sd.calls.clear()
    reconcile(store, systemd=sd, log=_quiet)
    steps = [c[0] for c in sd.calls if c[0] in ("firewall", "start")]
    assert steps == ["firewall", "start", "start"]
    assert (store.system_root / FIREWALL_FILE.lstrip("/")).read_text() == "# rules\n"
