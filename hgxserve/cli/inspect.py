"""`hgxserve inspect`: this host's serving state as JSON (what `hgxserve status` reads over SSH).

Kept apart from `status` so a host pays only for `hgxserve.status.host`'s imports.
"""

from __future__ import annotations

import json

import click

from hgxserve.base.paths import CACHE_ROOT, RELEASE_ROOT
from hgxserve.status.host import snapshot


@click.command("inspect")
@click.option("--root", default=RELEASE_ROOT, show_default=True, help="Release store directory.")
@click.option("--model-path", default=None, help="The model tree whose marker to read.")
@click.option(
    "--weights-state-dir",
    default=None,
    help="Where the marker lives when not MODEL_PATH/.hgxserve (CephFS verified in place).",
)
@click.option("--cache-root", default=CACHE_ROOT, show_default=True)
@click.option("--cache-key", "cache_keys", multiple=True, help="A cache key to look for.")
def inspect(
    root: str,
    model_path: str | None,
    weights_state_dir: str | None,
    cache_root: str,
    cache_keys: tuple[str, ...],
) -> None:
    """Print this host's serving state as JSON (read-only; what `hgxserve status` reads).

    Releases and the pending switch with its revert deadline, each unit of the running release
    (state, health, restarts, since), drift from the release, GPUs and the unit holding each,
    the weights marker, cache keys, and on the proxy's host the proxy's rotation and counters.

    \b
    hgxserve inspect --model-path /models/tiny
    """
    click.echo(
        json.dumps(
            snapshot(
                root=root,
                model_path=model_path,
                weights_state_dir=weights_state_dir,
                cache_root=cache_root,
                cache_keys=cache_keys,
            ),
            sort_keys=True,
        )
    )
