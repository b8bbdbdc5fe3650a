"""The release gate's probes against the simulated engine (its real HTTP protocol)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hgxserve.release.gate import GateError, GateSpec, run_gate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simengine"))

from harness import SimEngine  # noqa: E402

PROBE = {"prompt": "只输出：PD_OK", "expect": "PD_OK", "expect_regex": None, "max_tokens": 32}


def spec(url: str, **kw: object) -> GateSpec:
    return GateSpec(proxy_url=url, served_name="m", probe=dict(PROBE), **kw)  # type: ignore[arg-type]


def engine(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> SimEngine:
    return SimEngine("vllm", ["serve", "/m", "--served-model-name", "m", *args], tmp_path, env=env)


def test_probe_chat_stream_reasoning_and_tool_call_pass(tmp_path: Path) -> None:
    said: list[str] = []
    with engine(tmp_path, "--reasoning-parser", "deepseek_r1") as eng:
        result = run_gate(spec(eng.url, reasoning=True, tool_call=True), log=said.append)
    assert result["completion"]
    text = "\n".join(said)
    assert "chat probe on the combined path answered 'PD_OK'" in text
    assert "streamed chat probe on the combined path ok" in text
    assert "reasoning probe returned" in text
    assert "tool-call probe called get_weather(" in text


def test_a_model_answering_garbage_fails_the_gate(tmp_path: Path) -> None:
    # seed 003 §11.3: the Ray executor answered HTTP 200, deterministically, with garbage
    garbage = engine(tmp_path, env={"HGXSERVE_SIM_FAIL": "garbage"})
    with garbage as eng, pytest.raises(GateError, match="the chat probe .* expected 'PD_OK'"):
        run_gate(spec(eng.url), log=lambda m: None)


def test_expect_regex_and_completions_endpoint(tmp_path: Path) -> None:
    with engine(tmp_path) as eng:
        gate = spec(eng.url, chat=False)
        gate.probe.update(prompt="Only answer: 42", expect_regex=r"^\d+$")
        said: list[str] = []
        run_gate(gate, log=said.append)
        assert any("completion probe on the combined path answered '42'" in s for s in said)
        gate.probe.update(expect_regex=r"^[a-z]+$")
        with pytest.raises(GateError, match="not matching"):
            run_gate(gate, log=lambda m: None)


def test_reasoning_probe_fails_without_a_reasoning_parser(tmp_path: Path) -> None:
    with engine(tmp_path) as eng, pytest.raises(GateError, match="no reasoning content"):
        run_gate(spec(eng.url, reasoning=True), log=lambda m: None)


def test_wait_ready_warms_the_engine_up_before_it_counts_as_started(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from harness import http_json

    from hgxserve.cli.release import release

    with engine(tmp_path, "--max-model-len", "256") as eng:
        result = CliRunner().invoke(
            release,
            ["wait-ready", eng.url + "/health", "--timeout", "10", "--warmup", "16x8x4,240x16x1"],
        )
        assert result.exit_code == 0, result.output
        assert "hgxserve warm-up: 16x8x4 completions (topology): 4/4 answered" in result.output
        assert "hgxserve warm-up done: 2 shape(s)" in result.output
        status, body = http_json("GET", eng.url + "/sim/requests")
        assert status == 200
        assert sorted(r["prompt_tokens"] for r in body["requests"]) == [16, 16, 16, 16, 240]
        bad = CliRunner().invoke(release, ["wait-ready", eng.url + "/health", "--warmup", "9x"])
        assert bad.exit_code != 0 and "not a warm-up shape" in bad.output
