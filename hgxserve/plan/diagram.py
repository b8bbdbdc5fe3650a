"""A Graphviz picture of a topology: hosts as clusters, GPUs, engines, the proxy and P/D edges.

The DOT text is built here in Python; SVG/PNG need the `dot` binary (Debian: apt-get install
graphviz) and are skipped with a message when it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from hgxserve.topology.model import Engine, Route, Topology
from hgxserve.topology.ports import engine_url, side_channel_host, side_channel_ports

ROLE_COLOURS = {"prefill": "#4e79a7", "decode": "#f28e2b", "combined": "#59a14f"}
FREE_COLOUR = "#e0e0e0"


def _q(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _gpu_node(host: str, index: int) -> str:
    return _q(f"{host}/gpu{index}")


def topology_dot(topo: Topology) -> str:
    """DOT source for the topology.

    >>> print(topology_dot(load_topology("topologies/h20-v4flash-4p4d.yml")))  # doctest: +SKIP
    digraph "h20-v4flash-4p4d" { ...
    """
    owner: dict[tuple[str, int], str] = {}
    for engine in topo.engines.values():
        for host, gpus in engine.place.items():
            for gpu in gpus:
                owner.setdefault((host, gpu), engine.name)
    lines = [
        f"digraph {_q(topo.name)} {{",
        "  graph [rankdir=LR, fontname=Helvetica, fontsize=11, compound=true, "
        f"label={_q(topo.name + (' (baseline)' if topo.baseline else ''))}, labelloc=t];",
        "  node [fontname=Helvetica, fontsize=10];",
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    for name in topo.hosts:
        lines += _host_cluster(topo, name, owner)
    for engine in topo.engines.values():
        for host, gpus in engine.place.items():
            if host not in topo.hosts:
                continue
            for gpu in gpus:
                lines.append(
                    f"  {_q('engine/' + engine.name)} -> {_gpu_node(host, gpu)} "
                    '[arrowhead=none, color="#999999", style=dashed];'
                )
    lines += _proxy_edges(topo)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _host_cluster(topo: Topology, name: str, owner: dict[tuple[str, int], str]) -> list[str]:
    """One host: its GPUs (coloured by the engine that holds them), the engines it heads, and
    the proxy when it runs there."""
    host_info = topo.hosts[name]
    lines = [f"  subgraph {_q('cluster_' + name)} {{"]
    title = f"{name} ({host_info.address}, {host_info.gpus} x {host_info.gpu})"
    lines.append(f"    label={_q(title)};")
    lines.append('    style=rounded; color="#888888";')
    for index in range(host_info.gpus):
        engine_name = owner.get((name, index))
        gpu_engine = topo.engines.get(engine_name) if engine_name else None
        colour = ROLE_COLOURS.get(gpu_engine.role, FREE_COLOUR) if gpu_engine else FREE_COLOUR
        label = f"GPU {index}\\n{engine_name}" if engine_name else f"GPU {index}\\nfree"
        lines.append(
            f"    {_gpu_node(name, index)} [shape=box, style=filled, fillcolor={_q(colour)}, "
            f'label="{label}"];'
        )
    for engine in topo.engines.values():
        if engine.head != name:
            continue
        colour = ROLE_COLOURS.get(engine.role, FREE_COLOUR)
        detail = f"{engine.role}, {engine.engine}, tp {engine.tp}"
        if engine.dp > 1:
            detail += f" dp {engine.dp}"
        if engine.ep:
            detail += " ep"
        label = f"{engine.name}\\n{detail}\\n:{engine.port}"
        lines.append(
            f'    {_q("engine/" + engine.name)} [shape=ellipse, style="filled,bold", '
            f'fillcolor={_q(colour)}, label="{label}"];'
        )
    if topo.proxy is not None and topo.proxy.host == name:
        front = topo.proxy
        label = f"proxy ({front.kind})\\n{front.listen_host}:{front.listen_port}"
        lines.append(
            f'    "proxy" [shape=hexagon, style=filled, fillcolor="#bab0ac", label="{label}"];'
        )
    lines.append("  }")
    return lines


def _proxy_edges(topo: Topology) -> list[str]:
    """Proxy -> engine edges (combined and per route) and decode <- prefill KV edges."""
    proxy = topo.proxy
    if proxy is None:
        return []
    lines: list[str] = []
    for name in proxy.combined:
        if name in topo.engines:
            url = engine_url(topo, topo.engines[name])
            lines.append(f'  "proxy" -> {_q("engine/" + name)} [label={_q(url)}];')
    seen: set[tuple[str, str]] = set()
    for index, route in enumerate(proxy.routes):
        lines += _route_edges(topo, index, route, seen)
    return lines


def _route_edges(topo: Topology, index: int, route: Route, seen: set[tuple[str, str]]) -> list[str]:
    """One route's proxy -> engine edges and its KV edges, each edge once over all routes."""
    lines: list[str] = []
    for name in (*route.prefill, *route.decode):
        if name in topo.engines and ("proxy", name) not in seen:
            seen.add(("proxy", name))
            url = engine_url(topo, topo.engines[name])
            lines.append(
                f'  "proxy" -> {_q("engine/" + name)} [label={_q(f"route {index}: {url}")}];'
            )
    for p in route.prefill:
        for d in route.decode:
            pe = topo.engines.get(p)
            if pe is None or d not in topo.engines or (p, d) in seen:
                continue
            seen.add((p, d))
            lines.append(
                f"  {_q('engine/' + d)} -> {_q('engine/' + p)} [dir=back, "
                f'color="#e15759", penwidth=2, label="{_kv_label(topo, pe)}"];'
            )
    return lines


def _kv_label(topo: Topology, prefill: Engine) -> str:
    label = f"KV {prefill.kv.connector}" if prefill.kv else "KV"
    channels = [
        f"{side_channel_host(topo, prefill, h)}:{port}"
        for h in prefill.hosts
        if h in topo.hosts
        for _rank, port in side_channel_ports(prefill, h)
    ]
    if channels:
        shown = channels[0] + (f" (+{len(channels) - 1})" if len(channels) > 1 else "")
        label += f"\\nside channel {shown}"
    return label


def write_diagram(dot_text: str, out: str | Path) -> str:
    """Write the diagram to `out` (.dot, .svg or .png) and say what was written.

    Without the `dot` binary an .svg/.png request writes the .dot source next to it instead.
    """
    path = Path(out)
    suffix = path.suffix.lower()
    if suffix not in (".dot", ".gv", ".svg", ".png"):
        raise ValueError(f"diagram file must end in .dot, .svg or .png, not {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in (".dot", ".gv"):
        path.write_text(dot_text, encoding="utf-8")
        return f"diagram: wrote {path}"
    dot = shutil.which("dot")
    if dot is None:
        fallback = path.with_suffix(".dot")
        fallback.write_text(dot_text, encoding="utf-8")
        return (
            f"diagram: graphviz 'dot' not found, so no {suffix[1:].upper()}; wrote {fallback} "
            "instead (install graphviz, e.g. apt-get install graphviz)"
        )
    result = subprocess.run(
        [dot, f"-T{suffix[1:]}", "-o", str(path)],
        input=dot_text.encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise ValueError(f"dot failed: {result.stderr.decode(errors='replace').strip()}")
    return f"diagram: wrote {path}"
