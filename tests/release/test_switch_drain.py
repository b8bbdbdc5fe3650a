"""The hgxserve proxy across a switch, with systemd replaced by a recording fake: paused and
drained before engines stop, reloaded (not restarted) when a reload covers the change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_switch import UNITS, FakeSystemd

from hgxserve.release.store import ReleaseError, ReleaseSpec, Store, UnitSpec
from hgxserve.release.switch import start_proxy, switch

ENGINE = "hgxserve-combined-0.service"
PROXY = "hgxserve-proxy.service"
PROXY_JSON = "/etc/hgxserve/proxy.json"


class DrainSystemd(FakeSystemd):
    fail_once: set[str] = set()

    def start(self, unit: str) -> None:
        super().start(unit)
        if unit in self.fail_once:  # this start fails; the rollback's start works
            self.fail_once.discard(unit)
            self.failing.add(unit)

    def stop(self, unit: str) -> None:
        super().stop(unit)
        self.failing.discard(unit)

    def signal(self, unit: str, signal: str) -> None:
        self.calls.append(("signal", unit, signal))

    def reload(self, unit: str) -> None:
        assert unit in self.active, f"reload of {unit}, which is not running"
        self.calls.append(("reload", unit))


def proxy_json(*urls: str, port: int = 8000) -> str:
    return json.dumps(
        {
            "listen": {"host": "0.0.0.0", "port": port},
            "protocol": "vllm-nixl",
            "served_model_name": "m",
            "combined": list(urls),
        }
    )


def stage(
    store: Store, rid: str, *, engine: str = "/bin/engine", config: str | None = None
) -> ReleaseSpec:
    files = {
        f"{UNITS}/{ENGINE}": f"[Service]\nExecStart={engine}\n",
        f"{UNITS}/{PROXY}": "[Service]\nExecStart=/bin/proxy\nExecReload=/bin/kill -HUP $MAINPID\n",
        PROXY_JSON: config or proxy_json("http://127.0.0.1:8100"),
    }
    spec = ReleaseSpec(
        id=rid,
        topology=f"topo-{rid}",
        topology_digest=rid * 4,
        baseline=False,
        host="hgx-a",
        units=[UnitSpec(ENGINE, "engine"), UnitSpec(PROXY, "proxy", drain_s=0.2)],
        files=dict.fromkeys(files, 0o644),
        health_timeout_s=5,
    )
    for path, text in files.items():
        dest = store.release_dir(rid) / "tree" / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    (store.release_dir(rid) / "release.json").write_text(spec.to_json())
    return spec


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "lib"), system_root=str(tmp_path / "sys"))


def moves(sd: FakeSystemd) -> list[tuple[str, ...]]:
    return [c for c in sd.calls if c[0] in ("signal", "stop", "start", "reload")]


def running_on(store: Store, rid: str, **kw: str) -> DrainSystemd:
    stage(store, rid, **kw)
    sd = DrainSystemd()
    switch(store, rid, confirm_within_s=None, systemd=sd, log=lambda m: None)
    sd.calls.clear()
    return sd


def test_an_engine_change_pauses_the_proxy_first_and_reloads_it_after(store: Store) -> None:
    sd = running_on(store, "r1")
    stage(store, "r2", engine="/bin/engine --new")
    said: list[str] = []
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=said.append)
    assert moves(sd) == [
        ("signal", PROXY, "SIGUSR1"),  # 503 + Retry-After from here on; in-flight finish
        ("stop", ENGINE),
        ("start", ENGINE),
        ("reload", PROXY),  # admits again: never stopped, never refused a connection
    ]
    assert any(line.startswith(f"pausing {PROXY}") for line in said)


def test_deferred_proxy_stays_paused_until_start_proxy_reloads_it(store: Store) -> None:
    sd = running_on(store, "r1")
    stage(store, "r2", engine="/bin/engine --new")
    switch(store, "r2", confirm_within_s=60, defer_proxy=True, systemd=sd, log=lambda m: None)
    assert moves(sd) == [("signal", PROXY, "SIGUSR1"), ("stop", ENGINE), ("start", ENGINE)]
    sd.calls.clear()
    assert start_proxy(store, "r2", systemd=sd, log=lambda m: None) == "release r2: proxy reloaded"
    assert moves(sd) == [("reload", PROXY)]


def test_a_proxy_only_change_is_a_reload_and_nothing_else(store: Store) -> None:
    sd = running_on(store, "r1")
    new = proxy_json("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    stage(store, "r2", config=new)
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert moves(sd) == [("reload", PROXY)]  # no pause: nothing behind it stops
    assert (store.system_root / PROXY_JSON.lstrip("/")).read_text() == new


def test_a_change_a_reload_cannot_take_drains_then_restarts(store: Store) -> None:
    sd = running_on(store, "r1")
    stage(store, "r2", config=proxy_json("http://127.0.0.1:8100", port=9000))
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert moves(sd) == [
        ("signal", PROXY, "SIGUSR1"),
        ("stop", PROXY),  # SIGTERM finds nothing in flight: it exits at once
        ("start", PROXY),
    ]


def test_a_rollback_drains_the_same_way(store: Store) -> None:
    sd = running_on(store, "r1")
    stage(store, "r2", engine="/bin/engine --broken")
    sd.fail_once = {ENGINE}
    with pytest.raises(ReleaseError, match="rolled back to r1"):
        switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    calls = moves(sd)
    # paused before the new engine, and again before going back; reloaded, never stopped
    assert calls.count(("signal", PROXY, "SIGUSR1")) == 2
    assert ("stop", PROXY) not in calls and calls[-1] == ("reload", PROXY)
