"""The watcher of an engine that spans hosts: its unit and config on each of the engine's hosts.

Head and workers of a multi-node engine are one failure domain (hgxserve.release.watch): their
units have no `Restart=`, and one watcher per host restarts the engine as a whole. The head's
host leads; the others follow. The config is JSON in the release tree
(`/etc/hgxserve/watch/<engine>.json`, the fields of `hgxserve.release.watch.WatchConfig`).
"""

from __future__ import annotations

import json
from typing import Any

from hgxserve.base import defaults, paths
from hgxserve.base.paths import AGENT
from hgxserve.base.units import exec_line, path_list
from hgxserve.render.types import RenderedFile, RenderedUnit, templates, unit_name, watch_unit_name
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import engine_url, watch_url


def watch_config_path(engine: Engine) -> str:
    return f"{paths.WATCH_CONFIG_DIR}/{engine.name}.json"


def watch_state_path(engine: Engine) -> str:
    return f"{paths.WATCH_STATE_DIR}/{engine.name}.json"


def watch_config(topo: Topology, engine: Engine, host: str) -> dict[str, Any]:
    """What `host`'s watcher of `engine` watches: the leader (head host) its head's /health and
    every follower's /state; a follower its worker and the leader's /state."""
    leader = host == engine.head
    config: dict[str, Any] = {
        "engine": engine.name,
        "host": host,
        "role": "leader" if leader else "follower",
        "unit": unit_name(engine.name),
        "port": engine.watch_port,
        "state_file": watch_state_path(engine),
        "start_timeout_s": float(engine.start_timeout_s),
        "poll_s": defaults.WATCH_POLL_S,
        "down_after_s": defaults.WATCH_DOWN_AFTER_S,
        "follower_restart_s": defaults.WATCH_FOLLOWER_RESTART_S,
        "backoff_s": defaults.WATCH_BACKOFF_S,
    }
    if leader:
        config["health_url"] = engine_url(topo, engine, from_host=host) + "/health"
        config["followers"] = {
            peer: watch_url(topo, engine, peer) + "/state" for peer in engine.hosts[1:]
        }
    else:
        config["leader_url"] = watch_url(topo, engine, engine.head) + "/state"
    return config


def render_watch(
    topo: Topology, engine: Engine, host: str
) -> tuple[RenderedUnit, dict[str, RenderedFile]]:
    """The watcher unit of `engine` on `host` and its config file."""
    config = watch_config(topo, engine, host)
    path = watch_config_path(engine)
    name = watch_unit_name(engine.name)
    argv = [AGENT, "engine", "watch", "--config", path]
    content = (
        templates()
        .get_template("watch.service.j2")
        .render(
            topology=topo.name,
            role=config["role"],
            engine=engine.name,
            hosts=", ".join(engine.hosts),
            notes=[
                f"GET /state on port {engine.watch_port}; polls every {defaults.WATCH_POLL_S:g}s, "
                f"a member is down after {defaults.WATCH_DOWN_AFTER_S:g}s"
            ],
            description=f"hgxserve watcher ({config['role']}) of engine {engine.name}",
            engine_unit=unit_name(engine.name),
            exec_start=exec_line(argv),
            read_write_paths=path_list([paths.WATCH_STATE_DIR], optional=True),
        )
    )
    unit = RenderedUnit(
        name=name, engine=engine.name, role="watch", argv=argv, env={}, gpus=(), content=content
    )
    body = json.dumps(config, indent=2, sort_keys=True) + "\n"
    return unit, {unit.path: RenderedFile(content), path: RenderedFile(body)}
