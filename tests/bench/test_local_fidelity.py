"""Bench fidelity on 127.0.0.1: a real AIPerf through a real proxy to simulated engines whose
decode cannot reach the prefill's NIXL side channel (seed 003 §11.3: every transfer fails and
the decode recomputes the prompt), a dataset replayed, and a request-rate round.

The decode's `HGXSERVE_SIM_LOOPBACK` sends its pulls to 127.0.0.9, where nothing listens: the
simulated engine's own way of putting two engines on different hosts on one machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_local_bench import (  # the same local lab as the bench's own tests
    AIPERF_PYTHON,
    Lab,
    bench_round,
    local_lab,
)

pytestmark = pytest.mark.skipif(
    not AIPERF_PYTHON.exists(), reason="the bench load generator is missing: scripts/setup.sh"
)


@pytest.fixture(scope="module")
def broken_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with local_lab(
        tmp_path_factory.mktemp("bench-fidelity-lab"),
        env={"HGXSERVE_SIM_HANDSHAKE_TIMEOUT": "1"},
        decode_env={"HGXSERVE_SIM_LOOPBACK": "127.0.0.9"},
    ) as lab:
        yield lab


def test_failed_kv_transfers_make_the_pd_round_invalid_never_pass(
    broken_lab: Lab, tmp_path: Path
) -> None:
    proc, run, out = bench_round(
        broken_lab,
        tmp_path,
        "bench:\n  drain_timeout_s: 10\n  scenarios:\n"
        "    - {name: pd-long, input: 240, output: 8, concurrency: [2], requests: 4,\n"
        "       sla: {ttft_s: 30, tpot_ms: 400, statistic: mean}}\n",
        6,
    )
    assert "INVALID: pd-long c2:" in proc.stderr and "failed KV transfer(s)" in proc.stderr
    assert run["verdict"] == "INVALID" and run["passed"] is False
    assert run["scenario_verdicts"] == {"pd-long": "INVALID"}
    assert run["verdicts"] == []  # every SLA target met: the round is still no evidence
    (r,) = run["rounds"]
    assert r["valid"] is False and r["sent"] == r["engines_finished"] == 4 + 2
    assert r["kv"]["failed_transfers"] == 6  # every request, warm-ups included
    assert r["kv"]["decode_recomputed_tokens"] > 0
    (point,) = run["points"]
    assert point["verdict"] == "INVALID" and point["kv"]["failed_transfers"] == 6
    report = (out / run["run_id"] / "report.md").read_text()
    assert "result: INVALID" in report and "| pd-long | c2 | INVALID |" in report


def test_a_dataset_replayed_at_a_request_rate(broken_lab: Lab, tmp_path: Path) -> None:
    """Short prompts from a ShareGPT file go to combined-0 (below the P/D threshold); a
    constant request rate capped at concurrency 2."""
    conversations = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"Say hello number {i}"},
                                         {"from": "gpt", "value": "x" * 40}]}
        for i in range(6)
    ] + [{"id": "lonely", "conversations": [{"from": "human", "value": "no reply"}]}]  # fmt: skip
    (tmp_path / "chats.json").write_text(json.dumps(conversations))
    proc, run, out = bench_round(
        broken_lab,
        tmp_path,
        "bench:\n  drain_timeout_s: 10\n  scenarios:\n"
        "    - {name: chats, dataset: {path: chats.json, format: sharegpt}, rate: [4],\n"
        "       max_concurrency: 2, requests: 6, sla: {tpot_ms: 400, statistic: mean}}\n",
        0,
    )
    assert "6 prompts from" in proc.stderr and "1 conversations skipped" in proc.stderr
    assert run["verdict"] == "PASS" and run["scenario_verdicts"] == {"chats": "PASS"}
    (r,) = run["rounds"]
    assert r["point"] == "r4-c2" and r["valid"] is True and r["kv"]["pd"] is True
    assert r["sent"] == r["engines_finished"] == 6 + 2
    assert r["engines"]["engines"]["combined-0"]["requests_finished"] == 8
    # 40 characters of reply: 10 output tokens per request (the reply's characters / 4)
    assert r["engines"]["engines"]["combined-0"]["generation_tokens"] == 80
    replayed = (out / run["run_id"] / "rounds" / r["label"] / "dataset.jsonl").read_text()
    assert [json.loads(line)["text"] for line in replayed.splitlines()] == [
        f"Say hello number {i}" for i in range(6)
    ]
    assert [v["figure"] for v in run["points"][0]["verdicts"]] == ["TPOT mean"]
    assert r["telemetry"]["source"] is None and "inventory" in r["telemetry"]["why"]
