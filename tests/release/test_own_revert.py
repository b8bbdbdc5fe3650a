"""The controller waits for a self-reverting host's revert to finish and says where it ended."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from hgxserve.operations import release as ops


@dataclass
class _Output:
    stdout_lines: list[str]
    stderr_lines: list[str] = field(default_factory=list)


class _Host:
    """Answers the ReleaseState command with one scripted store reading per call."""

    name = "hgx-a"

    def __init__(self, readings: list[dict[str, Any]]) -> None:
        self.readings = readings
        self.reads = 0
        self.said: list[str] = []

    def run_shell_command(self, command: str) -> tuple[bool, _Output]:
        assert "pending.json" in command  # the ReleaseState fact's own command
        reading = self.readings[min(self.reads, len(self.readings) - 1)]
        self.reads += 1
        lines = [f"current={reading['current']}", "previous=", "baseline="]
        pending = reading.get("pending")
        lines.append("pending=" + (json.dumps(pending) if pending else ""))
        lines += [f"inactive={u}" for u in reading.get("inactive", [])]
        return True, _Output(lines)

    def log_styled(self, message: str, **_: Any) -> None:
        self.said.append(message)


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "OWN_REVERT_POLL_S", 0.01)


def test_waits_until_the_pending_record_clears() -> None:
    host = _Host(
        [
            {"current": "old1", "pending": {"id": "new2"}, "inactive": []},
            {"current": "old1", "pending": {"id": "new2"}, "inactive": ["hgxserve-d.service"]},
            {"current": "old1", "pending": None},
        ]
    )
    said = ops.await_own_revert(host, "new2", "/var/lib/hgxserve", within_s=30)  # type: ignore[arg-type]
    assert host.reads == 3
    assert said.startswith("its own revert finished (")
    assert said.endswith("final state: current old1, nothing pending, every unit of it running")


def test_bounded_and_says_what_is_still_pending() -> None:
    stuck = {"current": "old1", "pending": {"id": "new2"}, "inactive": ["hgxserve-d.service"]}
    host = _Host([stuck])
    said = ops.await_own_revert(host, "new2", "/var/lib/hgxserve", within_s=0.05)  # type: ignore[arg-type]
    assert said.startswith("its own revert still runs after 0s (pending new2)")
    assert "switch to new2 still pending, not running: hgxserve-d.service" in said


def test_a_pending_switch_to_another_release_is_not_this_revert() -> None:
    host = _Host([{"current": "old1", "pending": {"id": "other"}}])
    said = ops.await_own_revert(host, "new2", "/var/lib/hgxserve", within_s=30)  # type: ignore[arg-type]
    assert said.startswith("its own revert finished") and host.reads == 1
