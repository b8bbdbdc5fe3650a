"""The watcher of a multi-node engine (hgxserve.release.watch): its state machine with a fake
systemd, fake peers and a fake clock; its GET /state over a real socket."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hgxserve.release.watch import Members, WatchConfig, Watcher, _Handler

HEAD = "hgxserve-decode-0.service"
FOLLOWER_URL = "http://10.0.0.2:13346/state"
HEALTH = "http://127.0.0.1:8200/health"


class FakeMembers(Members):
    """Units with states, a head health, peers' /state answers; records systemctl calls."""

    def __init__(self) -> None:
        self.units: dict[str, str] = {HEAD: "active"}
        self.health = True
        self.peers: dict[str, dict[str, Any] | None] = {}
        self.calls: list[tuple[str, ...]] = []

    def unit_state(self, unit: str) -> str:
        return self.units.get(unit, "inactive")

    def systemctl(self, *args: str) -> None:
        self.calls.append(args)
        unit = args[-1]
        if args[0] == "stop":
            self.units[unit] = "inactive"
        elif args[0] in ("start", "restart"):
            self.units[unit] = "active"

    def healthy(self, url: str) -> bool:
        return self.health

    def peer_state(self, url: str) -> dict[str, Any] | None:
        return self.peers.get(url)


def watch_config(state_file: Path, **fields: Any) -> WatchConfig:
    """The watcher of engine decode-0 (its unit HEAD, its /state on 13346) on one host."""
    return WatchConfig(
        engine="decode-0", unit=HEAD, port=13346, state_file=str(state_file), **fields
    )


def leader(tmp_path: Path, **overrides: Any) -> tuple[Watcher, FakeMembers, list[str]]:
    config = watch_config(
        tmp_path / "decode-0.json",
        host="h-a",
        role="leader",
        health_url=HEALTH,
        followers={"h-b": FOLLOWER_URL},
        start_timeout_s=600,
        **overrides,
    )
    members = FakeMembers()
    members.peers[FOLLOWER_URL] = {"generation": 0, "unit_state": "active", "unit": HEAD}
    logged: list[str] = []
    return Watcher(config, members, logged.append), members, logged


def follower(tmp_path: Path) -> tuple[Watcher, FakeMembers]:
    config = watch_config(
        tmp_path / "follower.json",
        host="h-b",
        role="follower",
        leader_url="http://10.0.0.1:13346/state",
    )
    members = FakeMembers()
    return Watcher(config, members, lambda _: None), members


def dead_head(tmp_path: Path, **overrides: Any) -> tuple[Watcher, FakeMembers]:
    """A leader whose head unit has failed, as its first step (t=0) saw it."""
    watcher, members, _ = leader(tmp_path, **overrides)
    members.units[HEAD] = "failed"
    watcher.step(0.0)
    return watcher, members


def starting_head(tmp_path: Path) -> tuple[Watcher, FakeMembers]:
    """A recovery under way: after `dead_head`, the follower restarted its worker for
    generation 1 (seen at t=2) and the head is activating, not yet healthy."""
    watcher, members = dead_head(tmp_path)
    members.peers[FOLLOWER_URL] = {"generation": 1, "unit_state": "active", "unit": HEAD}
    members.health = False
    watcher.step(2.0)
    members.units[HEAD] = "activating"
    return watcher, members


def kinds(watcher: Watcher) -> list[str]:
    return [e["kind"] for e in watcher.state.events]


def test_a_healthy_engine_is_left_alone(tmp_path: Path) -> None:
    watcher, members, _ = leader(tmp_path)
    for now in range(0, 100, 2):
        watcher.step(float(now))
    assert members.calls == [] and watcher.state.generation == 0
    saved = json.loads((tmp_path / "decode-0.json").read_text())
    assert saved["phase"] == "watching" and saved["unit_state"] == "active"


def test_a_dead_worker_restarts_the_whole_engine_worker_first(tmp_path: Path) -> None:
    watcher, members, logged = leader(tmp_path)
    watcher.step(0.0)
    members.peers[FOLLOWER_URL] = {"generation": 0, "unit_state": "failed", "unit": HEAD}
    watcher.step(2.0)
    assert watcher.state.generation == 1 and watcher.state.phase == "waiting-followers"
    assert members.calls[0] == ("stop", HEAD)  # the head goes down with its worker
    assert "worker hgxserve-decode-0.service on h-b is failed" in logged[0]
    # the head waits until the follower restarted its worker for generation 1
    watcher.step(4.0)
    assert ("start", "--no-block", HEAD) not in members.calls
    members.peers[FOLLOWER_URL] = {"generation": 1, "unit_state": "active", "unit": HEAD}
    watcher.step(6.0)
    assert members.calls[-1] == ("start", "--no-block", HEAD)
    assert watcher.state.phase == "starting"
    watcher.step(8.0)
    assert watcher.state.phase == "watching" and watcher.state.restarts == 1
    assert kinds(watcher) == ["engine-down", "workers-restarted", "engine-recovered"]


def test_a_dead_head_is_noticed_at_once(tmp_path: Path) -> None:
    watcher, members, _ = leader(tmp_path)
    watcher.step(0.0)
    members.units[HEAD] = "failed"
    watcher.step(2.0)
    down = watcher.state.events[-1]
    assert down["kind"] == "engine-down" and down["down_hosts"] == "h-a"
    assert "is failed" in down["reason"]


def test_failing_health_counts_only_after_ready_and_for_down_after(tmp_path: Path) -> None:
    watcher, members, _ = leader(tmp_path, down_after_s=10.0)
    members.health = False
    for now in (0.0, 2.0, 30.0):  # never ready since the watcher started: a start, not a death
        watcher.step(now)
    assert watcher.state.generation == 0
    members.health = True
    watcher.step(32.0)
    members.health = False
    watcher.step(34.0)
    watcher.step(42.0)
    assert watcher.state.generation == 0  # 8 s of failing: not yet
    watcher.step(44.0)
    assert watcher.state.generation == 1
    assert "head /health failing for 10s" in watcher.state.events[-1]["reason"]


def test_an_unreachable_follower_is_down_after_down_after(tmp_path: Path) -> None:
    watcher, members, _ = leader(tmp_path, down_after_s=10.0)
    members.peers[FOLLOWER_URL] = None
    watcher.step(0.0)
    watcher.step(9.0)
    assert watcher.state.generation == 0
    watcher.step(10.0)
    assert watcher.state.generation == 1
    assert "watcher on h-b unreachable" in watcher.state.events[-1]["reason"]


def test_followers_that_do_not_restart_in_time_fail_the_recovery_and_back_off(
    tmp_path: Path,
) -> None:
    watcher, members = dead_head(tmp_path, follower_restart_s=30.0, backoff_s=60.0)
    watcher.step(31.0)
    assert kinds(watcher)[-1] == "recovery-failed" and watcher.state.phase == "watching"
    watcher.step(33.0)  # the head is still down, but the next try waits for the back-off
    assert watcher.state.generation == 1
    watcher.step(92.0)
    assert watcher.state.generation == 2


def test_a_head_that_does_not_become_healthy_is_bounded_by_the_start_timeout(
    tmp_path: Path,
) -> None:
    watcher, members = starting_head(tmp_path)
    watcher.step(300.0)
    assert watcher.state.phase == "starting"
    watcher.step(603.0)
    assert kinds(watcher)[-1] == "recovery-failed"
    assert "start timeout" in watcher.state.events[-1]["reason"]


def test_the_generation_survives_a_restart_of_the_watcher(tmp_path: Path) -> None:
    dead_head(tmp_path)
    again, _, _ = leader(tmp_path)
    assert again.state.generation == 1 and again.state.restarts == 1


def test_a_follower_adopts_the_leaders_generation_then_restarts_on_a_change(
    tmp_path: Path,
) -> None:
    watcher, members = follower(tmp_path)
    leader_url = "http://10.0.0.1:13346/state"
    members.peers[leader_url] = {"generation": 4}
    watcher.step(0.0)
    assert watcher.state.generation == 4 and members.calls == []
    members.peers[leader_url] = None  # the leader away: a follower does nothing on its own
    watcher.step(2.0)
    assert members.calls == []
    members.peers[leader_url] = {"generation": 5}
    watcher.step(4.0)
    assert members.calls == [("reset-failed", HEAD), ("restart", HEAD)]
    assert watcher.state.generation == 5 and watcher.state.restarts == 1
    watcher.step(6.0)
    assert len(members.calls) == 2


def test_a_follower_ignores_an_answer_without_a_generation(tmp_path: Path) -> None:
    watcher, members = follower(tmp_path)
    members.peers["http://10.0.0.1:13346/state"] = {"generation": "9; rm -rf /"}
    watcher.step(0.0)
    assert watcher.state.generation == 0 and members.calls == []


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    watcher, _, _ = leader(tmp_path)
    handler = type("H", (_Handler,), {"watcher": watcher})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_get_state_is_all_it_serves(served: str) -> None:
    with urllib.request.urlopen(served + "/state", timeout=5) as resp:
        state = json.loads(resp.read())
    assert state["role"] == "leader" and state["generation"] == 0
    assert state["hosts"] == ["h-a", "h-b"]
    members = Members()
    assert members.peer_state(served + "/state") == state
    assert members.peer_state(served + "/other") is None
    request = urllib.request.Request(served + "/state", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 501


def test_config_round_trips(tmp_path: Path) -> None:
    watcher, _, _ = leader(tmp_path)
    path = tmp_path / "c.json"
    path.write_text(watcher.config.to_json())
    assert WatchConfig.load(str(path)) == watcher.config


def test_a_follower_without_state_restarts_its_worker_when_the_leader_waits_for_it(
    tmp_path: Path,
) -> None:
    watcher, members = follower(tmp_path)
    members.peers["http://10.0.0.1:13346/state"] = {"generation": 3, "phase": "waiting-followers"}
    watcher.step(0.0)
    assert members.calls == [("reset-failed", HEAD), ("restart", HEAD)]
    assert watcher.state.generation == 3


def test_a_worker_that_dies_while_the_head_starts_fails_the_recovery_at_once(
    tmp_path: Path,
) -> None:
    watcher, members = starting_head(tmp_path)
    members.peers[FOLLOWER_URL] = {"generation": 1, "unit_state": "failed", "unit": HEAD}
    watcher.step(4.0)
    assert kinds(watcher)[-1] == "recovery-failed"
    assert "worker on h-b stopped" in watcher.state.events[-1]["reason"]
