"""Test hosts and simulated parts for hgxserve (never imported by product code).

``testbed.hosts`` boots Debian test hosts with systemd-nspawn (real systemd, real sshd, one
netns each); ``testbed/fakes`` holds the simulated GPU tools installed on them.

Example::

    import testbed
    bed = testbed.up(3)
    bed.ssh("hgx-a", "nvidia-smi -L")
    testbed.down()
"""

from testbed.hosts import Host, Testbed, down, load, require, status, up
from testbed.util import TestbedError

__all__ = ["Host", "Testbed", "TestbedError", "down", "load", "require", "status", "up"]
