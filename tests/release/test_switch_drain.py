"""The hgxserve proxy across a switch, with systemd replaced by a recording fake: paused and
drained before engines stop, reloaded (not restarted) when a reload covers the change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_switch import UNITS, FakeSystemd, stage_files

from hgxserve.operations.release import note_moves, pause_proxy
from hgxserve.release.coordination import Coordination, RunPlan
from hgxserve.release.store import ReleaseError, ReleaseSpec, Store, UnitSpec
from hgxserve.release.switch import moves as what_moves
from hgxserve.release.switch import pause_proxy as pause_here
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
    store: Store,
    rid: str,
    *,
    engine: str = "/bin/engine",
    config: str | None = None,
) -> ReleaseSpec:
    files = {
        f"{UNITS}/{ENGINE}": f"[Service]\nExecStart={engine}\n",
        f"{UNITS}/{PROXY}": "[Service]\nExecStart=/bin/proxy\nExecReload=/bin/kill -HUP $MAINPID\n",
        PROXY_JSON: config or proxy_json("http://127.0.0.1:8100"),
    }
    units = [UnitSpec(ENGINE, "engine"), UnitSpec(PROXY, "proxy", drain_s=0.2)]
    return stage_files(store, rid, files, units)


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


def test_moves_says_whether_engines_move_and_where_the_proxy_runs(store: Store) -> None:
    running_on(store, "r1")
    stage(store, "r2", engine="/bin/engine --new")
    stage(store, "r3", config=proxy_json("http://127.0.0.1:8100", "http://127.0.0.1:8101"))
    assert what_moves(store, "r2") == {"engines": True, "proxies": [PROXY]}
    assert what_moves(store, "r3") == {"engines": False, "proxies": [PROXY]}
    assert what_moves(store, "r1") == {"engines": False, "proxies": [PROXY]}


def test_a_proxy_the_controller_paused_is_reloaded_when_its_host_switches(store: Store) -> None:
    sd = running_on(store, "r1")
    assert pause_here(store, systemd=sd, log=lambda m: None) == f"paused {PROXY}"
    assert moves(sd) == [("signal", PROXY, "SIGUSR1")]
    sd.calls.clear()
    stage(store, "r2")  # another topology digest, the same units here: all kept
    switch(store, "r2", confirm_within_s=None, systemd=sd, log=lambda m: None)
    assert moves(sd) == [("reload", PROXY)]  # admits again; nothing stopped


class _Output:
    def __init__(self, stdout: str) -> None:
        self.stdout_lines = stdout.splitlines()
        self.stderr_lines: list[str] = []


class _Host:
    """A pyinfra host whose agent answers `release moves` with `found`."""

    def __init__(self, name: str, found: dict | None) -> None:
        self.name, self.found = name, found
        self.commands: list[str] = []

    def run_shell_command(self, command: str, **kw: object) -> tuple[bool, _Output]:
        self.commands.append(command)
        if "release moves" in command:
            return self.found is not None, _Output(json.dumps(self.found or {}))
        return True, _Output("")

    def log_styled(self, message: str, **kw: object) -> None:
        pass


def test_the_controller_pauses_the_proxy_before_other_hosts_engines_stop() -> None:
    coord = Coordination(RunPlan())
    proxy_host = _Host("hgx-c", {"engines": False, "proxies": [PROXY]})
    decode_host = _Host("hgx-b", {"engines": True, "proxies": []})
    same_host = _Host("hgx-a", {"engines": False, "proxies": []})
    for host in (proxy_host, decode_host, same_host):
        assert note_moves(None, host, coord, "r2", "/var/lib/hgxserve")  # type: ignore[arg-type]
    assert coord.record.engines_move == {"hgx-c": False, "hgx-b": True, "hgx-a": False}
    assert coord.record.proxy_hosts == {"hgx-c"}
    for host in (proxy_host, decode_host, same_host):
        pause_proxy(None, host, coord, "r2", "/var/lib/hgxserve")  # type: ignore[arg-type]
    assert [c for c in proxy_host.commands if "pause-proxy" in c] == [
        "/opt/hgxserve/bin/hgxserve release pause-proxy --root /var/lib/hgxserve"
    ]
    assert not [c for c in decode_host.commands + same_host.commands if "pause-proxy" in c]


def test_no_pause_when_only_the_proxy_host_moves_or_nothing_does() -> None:
    coord = Coordination(RunPlan())
    proxy_host = _Host("hgx-c", {"engines": True, "proxies": [PROXY]})
    other = _Host("hgx-b", {"engines": False, "proxies": []})
    for host in (proxy_host, other):
        note_moves(None, host, coord, "r2", "/r")  # type: ignore[arg-type]
        pause_proxy(None, host, coord, "r2", "/r")  # type: ignore[arg-type]
    # the proxy host's own engines: its switch pauses the proxy itself
    assert not [c for c in proxy_host.commands if "pause-proxy" in c]
    unknown = Coordination(RunPlan())
    note_moves(None, _Host("hgx-b", None), unknown, "r2", "/r")  # type: ignore[arg-type]
    assert unknown.record.engines_move == {"hgx-b": True}  # cannot tell: assume they move
