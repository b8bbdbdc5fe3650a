"""Credentials the controller pushes to a host ahead of a step that needs them on the host (a
cache bake starts an engine with its unit's secrets): each in a root 0600 file inside a root
0700 directory, as an upload, never on a command line."""

from __future__ import annotations

from pyinfra.api import deploy

from hgxserve.operations.credentials import secret_file


@deploy("Credentials for a cache bake")
def bake_credentials(*, values: dict[str, str]) -> None:
    """Install each host path -> value of `values` (nothing when it is empty)."""
    for path in sorted(values):
        secret_file(
            name=f"Install credential {path} for the bake (0600 in a 0700 directory)",
            dest=path,
            content=values[path],
        )
