"""The Prometheus text exposition format (0.0.4): writing metric families and reading samples.

Writing (the proxy's /metrics):

>>> out: list[str] = []
>>> family(out, "x_total", "counter", "Things.", [({"role": 'de"code'}, 3)])
>>> out
['# HELP x_total Things.', '# TYPE x_total counter', 'x_total{role="de\\\\"code"} 3']

Reading (engines' and the proxy's /metrics, for the release gate, `hgxserve status` and bench):

>>> parse_samples('up{job="a",why="down"} 1')
[('up', {'job': 'a', 'why': 'down'}, 1.0)]
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Labels = dict[str, str]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPED = re.compile(r'\\[\\"n]')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def label_value(text: str) -> str:
    """A label value as written: backslash, double quote and newline escaped.

    >>> label_value('a"b')
    'a\\\\"b'
    """
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sample(name: str, labels: Labels, value: object) -> str:
    """One exposition line; every label value escaped (label_value).

    >>> sample("up", {"job": "proxy"}, 1)
    'up{job="proxy"} 1'
    """
    if not labels:
        return f"{name} {value}"
    inner = ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}"


def family(
    out: list[str],
    name: str,
    kind: str,
    help_text: str,
    samples: list[tuple[Labels, object]],
) -> None:
    """Append one metric family to `out`: # HELP (when given), # TYPE, then its samples.

    family(out, "x_total", "counter", "Things.", [({"role": "decode"}, 3)])
    """
    if help_text:
        out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    out.extend(sample(name, labels, value) for labels, value in samples)


def histogram(  # noqa: PLR0913 - one exposition family: name, help, bounds, counts, sum, labels
    out: list[str],
    name: str,
    help_text: str,
    bounds: Sequence[float],
    counts: Sequence[int],
    total: float,
) -> None:
    """Append one histogram: # HELP, # TYPE, cumulative `_bucket`s (`le` each bound, then
    +Inf), `_count` and `_sum`. `counts[i]`: observations in bucket i alone; one more count
    than bounds (the last: above every bound).

    >>> out: list[str] = []
    >>> histogram(out, "t_seconds", "", (0.1, 1.0), [2, 1, 1], 2.5)
    >>> print("\\n".join(out[1:]))
    t_seconds_bucket{le="0.1"} 2
    t_seconds_bucket{le="1.0"} 3
    t_seconds_bucket{le="+Inf"} 4
    t_seconds_count 4
    t_seconds_sum 2.5
    """
    family(out, name, "histogram", help_text, [])
    labels = [str(bound) for bound in bounds] + ["+Inf"]
    acc = 0
    for le, n in zip(labels, counts, strict=True):
        acc += n
        out.append(sample(f"{name}_bucket", {"le": le}, acc))
    out += [sample(f"{name}_count", {}, acc), sample(f"{name}_sum", {}, total)]


def _labels(rest: str) -> tuple[Labels, str] | None:
    """The label set at the start of `rest` (`{...}`) and what follows it; None if malformed."""
    labels: Labels = {}
    pos = 1
    while pos < len(rest) and rest[pos] != "}":
        label = _LABEL.match(rest, pos)
        if not label:
            break
        labels[label.group(1)] = _ESCAPED.sub(lambda m: _UNESCAPE[m.group(0)], label.group(2))
        pos = label.end()
    if pos >= len(rest) or rest[pos] != "}":
        return None
    return labels, rest[pos + 1 :]


def parse_sample(line: str) -> tuple[str, Labels, float] | None:
    """One sample line as (name, labels, value); None for comments and lines it cannot read.

    >>> parse_sample('x_bucket{le="+Inf"} 7')
    ('x_bucket', {'le': '+Inf'}, 7.0)
    """
    line = line.strip()
    name = _NAME.match(line)  # comments (#) and blank lines do not match
    if not name:
        return None
    labels: Labels = {}
    rest = line[name.end() :]
    if rest.startswith("{"):
        parsed = _labels(rest)
        if parsed is None:
            return None  # not a sample line we understand
        labels, rest = parsed
    parts = rest.split()
    try:
        return (name.group(0), labels, float(parts[0])) if parts else None
    except ValueError:
        return None


def parse_samples(text: str) -> list[tuple[str, Labels, float]]:
    """Every sample of Prometheus text as (name, labels, value); label values unescaped.

    >>> parse_samples('# TYPE up gauge\\nup{job="a",why="down"} 1')
    [('up', {'job': 'a', 'why': 'down'}, 1.0)]
    """
    return [s for s in map(parse_sample, text.splitlines()) if s is not None]
