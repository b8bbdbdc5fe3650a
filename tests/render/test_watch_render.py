"""Rendering a multi-node engine as one failure domain: units without Restart=, a watcher unit
and config per host, the watcher's port in the port plan and in the release spec's start order."""

from __future__ import annotations

import json
from pathlib import Path

from hgxserve.release.plan import plan_release
from hgxserve.release.watch import WatchConfig
from hgxserve.render import render_host
from hgxserve.topology import load_topology
from hgxserve.topology.ports import listeners_by_host

REPO = Path(__file__).resolve().parents[2]
MULTI = REPO / "topologies/demo/demo-multinode.yml"
SINGLE = REPO / "topologies/demo/demo-pd.yml"


def test_multi_node_units_have_no_restart_and_a_watcher_each() -> None:
    topo = load_topology(MULTI)
    for host, role in (("hgx-a", "leader"), ("hgx-b", "follower")):
        render = render_host(topo, host)
        assert [u.name for u in render.units] == [
            "hgxserve-combined-0.service",
            "hgxserve-combined-0-watch.service",
        ]
        engine = render.files["/etc/systemd/system/hgxserve-combined-0.service"].content
        assert "Restart=on-failure" not in engine and "\nRestart=" not in engine
        watch = render.files["/etc/systemd/system/hgxserve-combined-0-watch.service"].content
        assert (
            "ExecStart=/opt/hgxserve/bin/hgxserve engine watch --config "
            "/etc/hgxserve/watch/combined-0.json" in watch
        )
        config = json.loads(render.files["/etc/hgxserve/watch/combined-0.json"].content)
        loaded = WatchConfig(**config)  # the rendered keys are the watcher's fields
        assert loaded.role == role and loaded.port == 13346
        assert loaded.unit == "hgxserve-combined-0.service"
        assert loaded.start_timeout_s == float(topo.engines["combined-0"].start_timeout_s)
    leader = json.loads(
        render_host(topo, "hgx-a").files["/etc/hgxserve/watch/combined-0.json"].content
    )
    assert leader["health_url"] == "http://127.0.0.1:8300/health"
    assert leader["followers"] == {"hgx-b": "http://10.77.0.12:13346/state"}
    follower = json.loads(
        render_host(topo, "hgx-b").files["/etc/hgxserve/watch/combined-0.json"].content
    )
    assert follower["leader_url"] == "http://10.77.0.11:13346/state"


def test_single_node_engines_keep_restart_and_get_no_watcher() -> None:
    topo = load_topology(SINGLE)
    render = render_host(topo, "hgx-a")
    assert all(u.role != "watch" for u in render.units)
    assert (
        "Restart=on-failure"
        in render.files["/etc/systemd/system/hgxserve-prefill-0.service"].content
    )


def test_the_watch_port_is_a_listener_on_every_host_of_the_engine() -> None:
    topo = load_topology(MULTI)
    listeners = listeners_by_host(topo)
    for host in ("hgx-a", "hgx-b"):
        watchers = [x for x in listeners[host] if x.what == "watcher"]
        assert [(x.port, x.owner) for x in watchers] == [(13346, "combined-0")]
    assert not [x for x in listeners["hgx-c"] if x.what == "watcher"]


def test_the_release_starts_watchers_after_the_engines() -> None:
    topo = load_topology(MULTI)
    head = plan_release(topo, "hgx-a").spec.units
    assert [(u.kind, u.health_url) for u in head] == [
        ("engine", "http://127.0.0.1:8300/health"),
        ("watch", "http://127.0.0.1:13346/state"),
    ]
    assert [u.kind for u in plan_release(topo, "hgx-b").spec.units] == ["worker", "watch"]
