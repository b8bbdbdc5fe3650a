"""The host firewall: one nftables table per host, rendered from the access plan
(hgxserve.topology.firewall, itself derived from the port plan in hgxserve.topology.ports).

The file is a release file (`/etc/hgxserve/firewall.nft`, hgxserve.base.paths.FIREWALL_FILE)
loaded with one `nft -f`: it declares the table, deletes it and defines it again, so the load
is one transaction (the old rules stay until the new ones replace them) and a second load
changes nothing. The controller's address is not in the topology: the table has two sets for
it, which the deploy fills from a file it writes under FIREWALL_INCLUDE_DIR (included at the end
of the same load), so the release, its id and `hgxserve render` do not depend on where the
deploy ran. The table only filters the ports of the plan: loopback is accepted, sshd and
every port hgxserve does not own are never matched, and the chain's policy is accept, so the
table never drops traffic another ruleset lets through (nor lets through what it drops).

Every value reaches the text through `nft_string` (comments) or as a validated address
(`ip_source`) or an integer port.

>>> print(render_firewall(topo, "hgx-a"))  # doctest: +SKIP
table inet hgxserve
delete table inet hgxserve
table inet hgxserve {
...
"""

from __future__ import annotations

import ipaddress
import re

from hgxserve.base.paths import FIREWALL_INCLUDE_DIR, FIREWALL_TABLE
from hgxserve.render.types import RenderError
from hgxserve.topology.firewall import Access, FirewallError, Source, access_plan, ip_source
from hgxserve.topology.model import Topology

_SAFE = re.compile(r"\A[A-Za-z0-9 ._:/()+,=-]*\Z")
_MAX_COMMENT = 120  # nftables keeps at most 128 bytes of a rule comment
CONTROLLER_SETS = (("ip", "controller_v4", "ipv4_addr"), ("ip6", "controller_v6", "ipv6_addr"))


def nft_string(text: str) -> str:
    """`text` as an nftables quoted string (comments): only plain characters, never a quote,
    a backslash or a control character, at most 120 of them.

    >>> nft_string("prefill-0 NIXL side channel (dp rank 0)")
    '"prefill-0 NIXL side channel (dp rank 0)"'
    >>> nft_string('x" accept')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    hgxserve.render.types.RenderError: ...
    """
    if not _SAFE.match(text) or len(text) > _MAX_COMMENT:
        raise RenderError(f"firewall: {text[:80]!r} cannot be an nftables comment")
    return f'"{text}"'


def _family(address: str) -> str:
    return "ip6" if ipaddress.ip_network(address).version == 6 else "ip"


def _accept_lines(item: Access) -> list[str]:
    """The accept rules of one listener (one per address family, and the controller's sets
    on an HTTP API), then its drop."""
    port = int(item.listener.port)
    label = f"{item.listener.label()} on {item.listener.host}"
    lines = []
    for family in ("ip", "ip6"):
        chosen: list[Source] = [s for s in item.sources if _family(s.address) == family]
        if not chosen:
            continue
        # revalidated here: nothing but a canonical address or network reaches the text
        addresses = ", ".join(ip_source(s.address, s.why) for s in chosen)
        lines.append(
            f"tcp dport {port} {family} saddr {{ {addresses} }} accept comment {nft_string(label)}"
        )
    if item.controller:
        for family, name, _ in CONTROLLER_SETS:
            lines.append(
                f"tcp dport {port} {family} saddr @{name} accept "
                f"comment {nft_string(label + ': controller')}"
            )
    lines.append(f"tcp dport {port} drop comment {nft_string(label + ': anyone else')}")
    return lines


def render_firewall(topo: Topology, host: str) -> str | None:
    """The ruleset file of `host`, or None when the firewall is off or nothing is filtered
    there (the switch then removes the table)."""
    try:
        plan = access_plan(topo, host)
    except FirewallError as exc:
        raise RenderError(f"host {host}: {exc}") from None
    if not plan:
        return None
    head = [
        f"# hgxserve host firewall of {nft_comment_text(host)} "
        f"(topology {nft_comment_text(topo.name)}); rendered, do not edit.",
        "# Loaded by `hgxserve release switch` and at boot by hgxserve-release-reconcile with",
        "# `nft -f`: declare, delete and define the table in one transaction.",
        f"table {FIREWALL_TABLE}",
        f"delete table {FIREWALL_TABLE}",
        f"table {FIREWALL_TABLE} {{",
        "\t# the controller's address as this host sees it: added by the deploy (firewall.d)",
        *(f"\tset {name} {{ type {kind}; flags interval; }}" for _, name, kind in CONTROLLER_SETS),
        "\tchain input {",
        "\t\ttype filter hook input priority filter; policy accept;",
        '\t\tiifname "lo" accept',
        "\t\tct state established,related accept",
    ]
    body = []
    for item in plan:
        who = [f"{s.why} {s.address}" for s in item.sources]
        who += ["the controller"] if item.controller else []
        body.append(
            f"\t\t# {nft_comment_text(item.listener.label())} "
            f"from {nft_comment_text(', '.join(who))}"
        )
        body += [f"\t\t{line}" for line in _accept_lines(item)]
    tail = ["\t}", "}", f'include "{FIREWALL_INCLUDE_DIR}/*.nft"', ""]
    return "\n".join([*head, *body, *tail])


def controller_elements(addresses: tuple[str, ...]) -> str:
    """The deploy's file under FIREWALL_INCLUDE_DIR: the controller's addresses, as the host
    sees them, added to the table's controller sets (each address validated first).

    >>> print(controller_elements(("10.77.0.1",)), end="")
    # the controller's address as this host sees it (written by the deploy)
    add element inet hgxserve controller_v4 { 10.77.0.1 }
    """
    lines = ["# the controller's address as this host sees it (written by the deploy)"]
    for family, name, _ in CONTROLLER_SETS:
        chosen = [ip_source(a, "controller") for a in addresses]
        chosen = [a for a in chosen if _family(a) == family]
        if chosen:
            lines.append(f"add element {FIREWALL_TABLE} {name} {{ {', '.join(chosen)} }}")
    return "\n".join(lines) + "\n"


def nft_comment_text(text: str) -> str:
    """`text` for a `#` comment line (any length): the characters nft_string allows."""
    if not _SAFE.match(text):
        raise RenderError(f"firewall: {text[:80]!r} cannot be an nftables comment")
    return text
