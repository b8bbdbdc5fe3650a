"""Addresses, ports and URLs as what they are: IP syntax or a hostname, ports 1..65535.

The schema only says "a string"; these functions say whether that string names a host a socket
can bind to or dial, and give one spelling per address so that two host entries for the same
machine are found.

>>> address_problem("10.0.0.300")
"'10.0.0.300' looks like an IPv4 address but is not one (four numbers 0-255)"
>>> address_problem("h20-a.lab") is None
True
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

MAX_PORT = 65535
_LABEL = re.compile(r"\A(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
_NUMERIC = re.compile(r"\A[0-9.]+\Z")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def address_problem(text: str) -> str | None:
    """Why `text` is neither an IP address nor a hostname (RFC 1123), or None when it is one.

    >>> address_problem("1.2.3")
    "'1.2.3' looks like an IPv4 address but is not one (four numbers 0-255)"
    >>> [address_problem(a) for a in ("::1", "fe80::1", "localhost", "gpu-01")]
    [None, None, None, None]
    >>> address_problem("host_1")  # doctest: +ELLIPSIS
    "'host_1' is neither an IP address nor a hostname ..."
    """
    if _ip(text) is not None:
        return None
    if ":" in text:
        return f"{text!r} is not an IPv6 address"
    if _NUMERIC.match(text):
        return f"{text!r} looks like an IPv4 address but is not one (four numbers 0-255)"
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        return (
            f"{text!r} is neither an IP address nor a hostname (letters, digits and '-' in "
            "dot-separated labels)"
        )
    if labels[-1].isdigit():
        return f"{text!r}: a hostname's last label is not all digits"
    return None


def canonical(address: str) -> str:
    """One spelling per address: IPs in their compressed form, hostnames in lower case.

    >>> canonical("FE80:0::1"), canonical("H20-A.lab.")
    ('fe80::1', 'h20-a.lab')
    """
    ip = _ip(address)
    if ip is not None:
        return str(ip)
    return address.lower().rstrip(".")


def port_problem(port: int) -> str | None:
    if 0 < port <= MAX_PORT:
        return None
    return f"port {port} is outside 1-{MAX_PORT}"


def url_problem(url: str) -> str | None:
    """What is wrong with the host or port of an http(s) URL, or None.

    >>> url_problem("https://s3.lab:70000")
    "'https://s3.lab:70000': port 70000 is outside 1-65535"
    >>> url_problem("http://10.77.0.1:9000") is None
    True
    """
    try:
        netloc = urlsplit(url).netloc.rpartition("@")[2]
    except ValueError as exc:  # an unclosed [ of an IPv6 host
        return f"{url!r}: {exc}"
    if not netloc:
        return f"{url!r} names no host"
    host, port = netloc, ""
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        if rest and not rest.startswith(":"):
            return f"{url!r}: write the host as [IPv6]:port"
        port = rest[1:]
    elif ":" in netloc:
        host, _, port = netloc.rpartition(":")
    if port or netloc.endswith(":"):
        if not port.isdigit():
            return f"{url!r}: the port {port!r} is not a number"
        bad = port_problem(int(port))
        if bad:
            return f"{url!r}: {bad}"
    bad = address_problem(host)
    return f"{url!r}: {bad}" if bad else None


def hostport_problem(text: str) -> str | None:
    """What is wrong with a `host:port` (`[v6]:port`) pair, or None.

    >>> hostport_problem("10.0.0.1:6789") is None
    True
    >>> hostport_problem("mon-1:0")
    "'mon-1:0': port 0 is outside 1-65535"
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return f"{text!r} is not host:port"
    bracketed = host.startswith("[") and host.endswith("]")
    if ":" in host and not bracketed:
        return f"{text!r}: write an IPv6 address in brackets, [addr]:port"
    bad = port_problem(int(port))
    if bad:
        return f"{text!r}: {bad}"
    bad = address_problem(host[1:-1] if bracketed else host)
    return f"{text!r}: {bad}" if bad else None
