"""The proxy's /metrics text: every family passes `promtool check metrics`, and label values
that hold quotes, backslashes or newlines are escaped (one sample stays one line)."""

from __future__ import annotations

import re
import shutil
import subprocess
import types

import pytest

from hgxserve.base.promtext import family
from hgxserve.proxy.metrics import Metrics


def _instance(role: str, url: str, healthy: bool, reason: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        role=role, url=url, healthy=healthy, reason=reason, outstanding=1, since=1700000000.0
    )


def _rendered() -> str:
    pool = types.SimpleNamespace(
        instances=[
            _instance("prefill", "http://10.0.0.1:8100", True, ""),
            _instance("decode", "http://10.0.0.2:8200", False, 'health: "503"\nC:\\x'),
        ]
    )
    metrics = Metrics()
    metrics.request('odd"route\nx', "/v1/completions", 200)
    metrics.upstream_error(pool.instances[1], "connect")
    metrics.kv_handoff("ok")
    metrics.observe_added_ttft(0.003)
    return metrics.render(pool)  # type: ignore[arg-type]


def test_label_values_are_escaped_so_each_sample_is_one_line() -> None:
    text = _rendered()
    lines = text.splitlines()
    assert 'route="odd\\"route\\nx"' in text
    assert 'reason="health: \\"503\\"\\nC:\\\\x"' in text
    # every line is a comment or one sample: name, optional {labels}, a number
    sample = re.compile(r'^[a-z_]+(\{([a-z]+="([^"\\]|\\.)*",?)*\})? [0-9.e+-]+$')
    for line in lines:
        assert line.startswith("# ") or sample.match(line), line


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_exposition() -> None:
    run = subprocess.run(
        ["promtool", "check", "metrics"], input=_rendered(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_family_without_samples_still_declares_its_type() -> None:
    out: list[str] = []
    family(out, "x_total", "counter", "Things.", [])
    assert out == ["# HELP x_total Things.", "# TYPE x_total counter"]
