"""Topology values reach units through one escaping function: nothing can add a directive.

The loader already refuses control characters (tests/topology/invalid/control-character.yml);
these tests go around it, as a topology built in code would, and show the renderer refuses too.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import topology

from hgxserve.base.units import UnitValueError, environment_value, exec_line, unit_value
from hgxserve.render import RenderError, render_host

HOSTILE = ["\n", "\r", "\x00", "\x1b", "\x7f", "\x85", "\u2028", "\t"]


@pytest.mark.parametrize("char", HOSTILE, ids=lambda c: f"U+{ord(c):04X}")
def test_unit_value_refuses_control_characters(char: str) -> None:
    with pytest.raises(UnitValueError):
        unit_value(f"/models/m{char}ExecStartPre=/bin/touch /var/p")
    # inside quotes a control character is a C escape: the line stays one line
    for text in (exec_line(["/bin/x", f"a{char}b"]), environment_value("A", f"a{char}b")):
        assert len(text.splitlines()) == 1 and char not in text


def test_unit_value_escapes_specifiers_and_refuses_a_continuation() -> None:
    assert unit_value("50%n") == "50%%n"
    with pytest.raises(UnitValueError, match="backslash"):
        unit_value("x\\")
    # inside a quoted word a trailing backslash is escaped, not refused
    assert exec_line(["/bin/x", "a\\"]) == '/bin/x "a\\\\"'


def _with_model_path(path: str):
    topo = topology("h20-v4flash-tp8.yml")
    return dataclasses.replace(topo, model=dataclasses.replace(topo.model, path=path))


def _directives(content: str) -> list[str]:
    return [line.split("=", 1)[0] for line in content.splitlines() if re.match(r"^[A-Z]\w+=", line)]


@pytest.mark.parametrize("value", ["/m\nExecStartPre=/bin/touch /var/p", "/m\rUser=root"])
def test_a_line_break_in_a_value_never_adds_a_directive(value: str) -> None:
    """Quoted words carry it as a C escape; anything printed bare is refused."""
    plain = _with_model_path("/m")
    host = next(iter(plain.hosts_in_use()))
    before = render_host(plain, host).units[0].content
    after = render_host(_with_model_path(value), host).units[0].content
    assert _directives(before) == _directives(after)
    assert "\r" not in after and not re.search(r"^(ExecStartPre=/bin/touch|User=root)", after, re.M)
    topo = topology("h20-v4flash-tp8.yml")
    named = dataclasses.replace(topo, name="t\nExecStartPre=/bin/touch /var/p")
    with pytest.raises(RenderError, match="control character"):
        render_host(named, host)


def test_odd_but_legal_values_stay_one_word() -> None:
    """Spaces, quotes, `%` and `$` in a path change no directive and read back unchanged."""
    plain = _with_model_path("/models/m")
    odd = _with_model_path('/models/m x%i$HOME"q')
    host = next(iter(plain.hosts_in_use()))
    before = render_host(plain, host).units[0].content
    after = render_host(odd, host).units[0].content
    assert _directives(before) == _directives(after)
    assert 'ReadOnlyPaths=-"/models/m x%%i$$HOME\\"q"' in after
    assert "%i" not in after.replace("%%", "")


def test_templates_escape_plain_values() -> None:
    """Values the templates print without a quoting helper (Description=) are escaped too."""
    topo = topology("h20-v4flash-tp8.yml")
    topo = dataclasses.replace(topo, model=dataclasses.replace(topo.model, served_name="m%n"))
    host = topo.proxy.host if topo.proxy else next(iter(topo.hosts_in_use()))
    units = render_host(topo, host).units
    descriptions = [line for u in units for line in u.content.splitlines() if "m%" in line]
    assert descriptions and all("m%%n" in line for line in descriptions)
