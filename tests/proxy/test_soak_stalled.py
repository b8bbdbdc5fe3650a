"""The soak benchmark's stalled-clients scenario (benchmarks/bench_proxy_soak.py --scenario
stalled) at small numbers: a real proxy and simulated engine on 127.0.0.1, 8 streams that stop
reading and a holder of a 64-connection door. The measurement itself is checked here (every
stream cut and counted, the holder held its share, nothing failed, the proxy left with nothing
in flight); the latency ratio is only measured at full size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_proxy_soak import parse_args, run_stalled, stalled_misses  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_stalled_scenario_measures_at_small_numbers(tmp_path: Path) -> None:
    args = parse_args(
        ["--scenario", "stalled", "--streams", "8", "--requests", "20", "--write-timeout-s",
         "16", "--max-connections", "64", "--rounds", "2"]
    )  # fmt: skip
    r = run_stalled(args, tmp_path)
    assert len(r["unloaded"]) == len(r["loaded"]) == 20
    assert r["unloaded_err"] == r["loaded_err"] == 0
    assert r["streams_opened"] == 8 and r["streams_failed"] == 0
    # its share of 64 connections at 0.5: 32 held, the 33rd answered 503
    assert r["holder"]["held_while_loaded"] == 32 and r["holder"]["refused"] >= 1
    # every stream cut once its writes blocked for client_write_timeout_s, none earlier
    assert r["stalled"] == 8 and r["stalled_while_loaded"] == 0
    assert [x["stalled"] for x in r["rounds"]] == [8, 16]
    assert r["in_flight_after"] == 0
    before, peak, after, hwm = r["rss"]
    assert 0 < before <= peak <= hwm and after <= hwm
    misses = stalled_misses(r, args)
    assert [m for m in misses if "p99" not in m] == [], misses
    # the run's key file went with the run; the proxy wanted it on /metrics
    assert "metrics_key_file" in (tmp_path / "hgxserve.json").read_text()
    assert args.metrics_key not in (tmp_path / "hgxserve.log").read_text()
