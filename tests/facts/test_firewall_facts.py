"""ControllerAddress: the client address of the SSH connection a deploy runs over, as the host's
shell sees it in $SSH_CONNECTION (what the host firewall allows on the engines' HTTP APIs)."""

from __future__ import annotations

import subprocess

import pytest

from hgxserve.facts.host import ControllerAddress, HostFirewall


def _run(env: dict[str, str]) -> str | None:
    fact = ControllerAddress()
    proc = subprocess.run(
        ["sh", "-c", fact.command()],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert proc.returncode == 0, proc.stderr
    return fact.process(proc.stdout.splitlines())


@pytest.mark.parametrize(
    "value,address",
    [
        ("10.77.0.1 36830 10.77.0.11 22", "10.77.0.1"),
        ("fd00:77:0:0::1 50000 fd00:77::11 22", "fd00:77::1"),
        ("fe80::1%eth0 50000 fe80::2%eth0 22", "fe80::1"),
        ("", None),
        ("not-an-address 1 2 3", None),
        ("$(reboot) 1 2 3", None),
    ],
)
def test_the_client_address_of_the_ssh_connection(value: str, address: str | None) -> None:
    assert _run({"SSH_CONNECTION": value}) == address


def test_no_ssh_connection_is_none() -> None:
    assert _run({}) is None


@pytest.mark.parametrize(
    "lines,state",
    [(["loaded"], "loaded"), (["missing"], "missing"), (["none"], "none"), ([], "none")],
)
def test_host_firewall_state(lines: list[str], state: str) -> None:
    # the command itself runs on the test hosts (tests/e2e/test_firewall.py: a lost table)
    assert HostFirewall().process(lines) == state
