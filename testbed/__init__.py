"""Test hosts and simulated parts for hgxserve (never imported by product code).

``testbed.hosts`` boots Debian test hosts with systemd-nspawn (real systemd, real sshd, one
netns each); ``testbed.lab`` runs several such labs on one machine; ``testbed/fakes`` holds the
simulated GPU tools installed on them.

Example::

    import testbed
    bed = testbed.up(3)
    bed.ssh("hgx-a", "nvidia-smi -L")
    testbed.down()

The names below come from ``testbed.hosts`` when first used, not when ``testbed`` is imported:
``testbed.hosts`` reads its lab's state directory at import, so ``testbed.lab.enter`` must be
able to run first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Host", "Testbed", "TestbedError", "down", "load", "require", "status", "up"]


def __getattr__(name: str) -> Any:
    if name == "TestbedError":
        from testbed.util import TestbedError

        return TestbedError
    if name in __all__:
        from testbed import hosts

        return getattr(hosts, name)
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")
