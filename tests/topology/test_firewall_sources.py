"""firewall.allow: no entry turns the firewall off (rule firewall-wide), and an IPv6 zone is an
interface name, or validate refuses what render could not write."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hgxserve.render.firewall import render_firewall
from hgxserve.topology import check_topology, load_topology
from hgxserve.topology.firewall import FirewallError, ip_source, too_wide


def _topology(allow: list[str], accept: dict[str, str] | None = None) -> str:
    doc = {
        "name": "wall",
        "hosts": {"h-a": {"address": "10.0.0.11", "gpu": "H200"}},
        "model": {
            "name": "m",
            "served_name": "m",
            "path": "/models/m",
            "source": {"local": {"path": "/models/m"}},
        },
        "engines": {
            "combined-0": {
                "role": "combined",
                "engine": "vllm",
                "runtime": {"venv": "/opt/vllm"},
                "place": {"h-a": [0, 1]},
                "tp": 2,
                "port": 8100,
                "args": {"max_num_seqs": 8},
            }
        },
        "proxy": {"host": "h-a", "combined": ["combined-0"]},
        "firewall": {"allow": allow},
        **({"accept": accept} if accept else {}),
    }
    return yaml.safe_dump(doc)


def _errors(tmp_path: Path, text: str) -> list[tuple[str, str]]:
    path = tmp_path / "t.yml"
    path.write_text(text)
    return [(p.rule, p.message) for p in check_topology(str(path)).problems if p.is_error]


@pytest.mark.parametrize(
    "entry",
    ["0.0.0.0/0", "10.0.0.1/0", "::/0", "0::0/0", "::ffff:0:0/96", "::ffff:0.0.0.0/100",
     "0.0.0.0/7", "10.0.0.0/7", "2000::/3", "2001:db8::/31"],
)  # fmt: skip
def test_one_wide_entry_is_refused(tmp_path: Path, entry: str) -> None:
    assert [r for r, _ in _errors(tmp_path, _topology([entry]))] == ["firewall-wide"]


def test_wide_pieces_together_are_refused_and_the_private_ranges_pass(tmp_path: Path) -> None:
    pieces = [f"{n}.0.0.0/8" for n in range(1, 6)]
    assert [r for r, _ in _errors(tmp_path, _topology(pieces))] == ["firewall-wide"]
    private = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fd00::/32", "2001:db8::/32"]
    assert _errors(tmp_path, _topology(private)) == []


def test_an_accepted_wide_entry_passes(tmp_path: Path) -> None:
    text = _topology(["0.0.0.0/0"], {"$.firewall.allow[0]": "a lab with no other guard"})
    assert _errors(tmp_path, text) == []


def test_the_bound_is_said_with_the_normalised_network() -> None:
    why = too_wide("10.0.0.1/0")
    assert why is not None and "'10.0.0.1/0' is 0.0.0.0/0" in why and "/8" in why
    assert too_wide("10.0.0.0/8") is None and too_wide("2001:db8::/32") is None


@pytest.mark.parametrize(
    "text",
    ["fe80::1%eth0 } accept", "fe80::1%$(id)", "fe80::1%", "fe80::1%a/b", "fe80::/64%eth0",
     "10.0.0.1%eth0", "fe80::1%" + "x" * 16, "fe80::1%eth0\nflush ruleset"],
)  # fmt: skip
def test_a_zone_that_is_no_interface_name_is_refused(text: str) -> None:
    with pytest.raises(FirewallError):
        ip_source(text, "firewall.allow")


def test_a_zone_that_is_an_interface_name_validates_and_renders(tmp_path: Path) -> None:
    assert ip_source("fe80::1%eth0", "x") == ip_source("fe80::1%2", "x") == "fe80::1"
    text = _topology(["fe80::1%enp1s0f0.100"])
    assert _errors(tmp_path, text) == []
    path = tmp_path / "t.yml"
    path.write_text(text)
    table = render_firewall(load_topology(str(path)), "h-a")
    assert table is not None and "fe80::1 " in table and "%" not in table
