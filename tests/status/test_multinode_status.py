"""`hgxserve status` and `logs` for an engine that spans hosts: one row with its hosts and its
watcher (hgxserve.release.watch); the watcher's GET /state summarised by the host side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hgxserve.status.host import watch_summary
from hgxserve.status.journal import journal_argv
from hgxserve.status.report import HostView, Report
from hgxserve.status.table import _multinode_lines
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
MULTI = load_topology(REPO / "topologies/demo/demo-multinode.yml")
NOW = 1_800_000_000.0


def _view(host: str, active: str, watch: dict[str, Any] | None) -> HostView:
    units: list[dict[str, Any]] = [{"name": "hgxserve-combined-0.service", "active": active}]
    watcher: dict[str, Any] = {"name": "hgxserve-combined-0-watch.service", "active": "active"}
    if watch is not None:
        watcher["watch"] = watch
    return HostView(host, "", True, snapshot={"units": [*units, watcher]})


def _report(head: HostView, worker: HostView) -> Report:
    return Report("demo-multinode", "", NOW, {"hgx-a": head, "hgx-b": worker}, [])


def test_a_multi_node_engine_is_one_row_with_its_hosts_and_watcher() -> None:
    event = {"at": NOW - 30, "kind": "engine-down", "generation": 2,
             "reason": "worker hgxserve-combined-0.service on hgx-b is failed"}  # fmt: skip
    watch = {"generation": 2, "phase": "waiting-followers", "restarts": 2, "events": [event]}
    lines = _multinode_lines(
        _report(_view("hgx-a", "inactive", watch), _view("hgx-b", "failed", {})), MULTI
    )
    assert lines[1].split() == ["ENGINE", "HOSTS", "PARTS", "WATCHER", "RESTARTS", "LAST", "EVENT"]
    row = lines[2]
    assert row.startswith("combined-0  hgx-a+hgx-b  hgx-a inactive, hgx-b failed")
    assert "gen 2 waiting-followers" in row and "2 restarts" in row
    assert "engine-down" in row and "(worker hgxserve-combined-0.service on hgx-b is failed)" in row


def test_a_head_host_without_an_answering_watcher_says_so() -> None:
    lines = _multinode_lines(
        _report(_view("hgx-a", "active", None), _view("hgx-b", "active", None)), MULTI
    )
    assert "NOT RUNNING" in lines[2]


def test_single_node_topologies_have_no_such_table() -> None:
    topo = load_topology(REPO / "topologies/demo/demo-pd.yml")
    assert _multinode_lines(Report("demo-pd", "", NOW, {}, []), topo) == []


def test_watch_summary_keeps_the_last_events_and_refuses_non_json() -> None:
    state = {"role": "leader", "generation": 7, "restarts": 7, "phase": "watching",
             "unit_state": "active", "hosts": ["hgx-a", "hgx-b"],
             "events": [{"kind": f"e{i}"} for i in range(9)], "other": "x"}  # fmt: skip
    summary = watch_summary(json.dumps(state))
    assert summary["generation"] == 7 and "other" not in summary
    assert [e["kind"] for e in summary["events"]] == ["e4", "e5", "e6", "e7", "e8"]
    assert "error" in watch_summary("<html>") and "error" in watch_summary("[1]")


def test_logs_read_the_engine_and_its_watcher_together() -> None:
    argv = journal_argv(
        ["hgxserve-combined-0.service", "hgxserve-combined-0-watch.service"], 200, None, False
    )
    assert argv[:5] == [
        "journalctl", "-u", "hgxserve-combined-0.service",
        "-u", "hgxserve-combined-0-watch.service",
    ]  # fmt: skip


def test_the_last_event_tells_what_went_down_before_the_recovery() -> None:
    down = {"at": NOW - 30, "kind": "engine-down", "generation": 3,
            "reason": "head unit hgxserve-combined-0.service on hgx-a is failed"}  # fmt: skip
    back = {"at": NOW - 20, "kind": "engine-recovered", "generation": 3, "restarts": 3}
    watch = {"generation": 3, "phase": "watching", "restarts": 3, "events": [down, back]}
    row = _multinode_lines(
        _report(_view("hgx-a", "active", watch), _view("hgx-b", "active", {})), MULTI
    )[2]
    assert "engine-recovered" in row and "after engine-down" in row
    assert row.endswith("(head unit hgxserve-combined-0.service on hgx-a is failed)")
