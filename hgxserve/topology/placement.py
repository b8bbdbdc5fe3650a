"""Where the engines read a model's weights, and where its verified marker lives.

One place for both, used by the weights stage (which writes the marker) and by the rendered
engine units (whose `ExecStartPre=hgxserve weights check-marker` reads it):

- S3 / local sources, and CephFS with `stage: true`: the tree is `model.path` (synced or staged
  onto local disk), the marker in `<model.path>/.hgxserve/`;
- CephFS in place (the default): the tree is the read-only mount `source.mount`, the marker in
  `/var/lib/hgxserve/weights/<model name>/` (the mount cannot be written).
"""

from __future__ import annotations

import dataclasses

from hgxserve.base.paths import weights_state_dir
from hgxserve.topology.model import CephfsSource, Model, Topology


def serving_tree(model: Model) -> tuple[str, str | None]:
    """(the directory the engines read, the marker's state dir or None for the default)."""
    source = model.source
    if isinstance(source, CephfsSource) and not source.stage:
        return source.mount, weights_state_dir(model.name)
    return model.path, None


def serving_mounts(model: Model) -> list[str]:
    """The mount points the engines' tree lives on: the CephFS mount in place, else none.

    The engine units order themselves after it and pull it in (`After=`, `Wants=`), so a boot
    starts no engine before its store is mounted. Not `Requires=`/`RequiresMountsFor=`: those
    would restart every engine whenever the weights stage remounts a changed mount unit, outside
    the release; an engine whose mount is missing is refused by its check-marker instead (the
    files the marker lists are not there).
    """
    source = model.source
    if isinstance(source, CephfsSource) and not source.stage:
        return [source.mount]
    return []


def check_marker_args(model: Model) -> list[str]:
    """`weights check-marker` arguments for the engine units (tree, state dir, pinned digest)."""
    tree, state_dir = serving_tree(model)
    args = [tree]
    if state_dir:
        args += ["--state-dir", state_dir]
    if model.digest:
        args += ["--digest", model.digest]
    return args


def pin_digest(topo: Topology, digest: str | None) -> Topology:
    """`topo` with the weights pinned to `digest` (`--data weights_digest=`), if given."""
    if not digest or digest == topo.model.digest:
        return topo
    return dataclasses.replace(topo, model=dataclasses.replace(topo.model, digest=digest))


def proxy_tokenizer(topo: Topology) -> tuple[str | None, str]:
    """(the directory the hgxserve proxy loads tokenizer.json and the chat template from, or None
    for the approximate character index; why).

    The weights are on the hosts that run an engine (the weights stage verifies them there
    before any engine starts), so the proxy reads them where it runs beside an engine.
    """
    proxy = topo.proxy
    if proxy is None:
        return None, "no proxy"
    if proxy.routing.tokenizer == "none":
        return None, "proxy.routing.tokenizer is none: approximate character index"
    if not topo.engines_on(proxy.host):
        return None, (
            f"the proxy host {proxy.host} runs no engine, so it holds no weights to read the "
            "tokenizer from: approximate character index"
        )
    tree = serving_tree(topo.model)[0]
    return tree, f"the model's tokenizer from the weights on {proxy.host} ({tree})"
