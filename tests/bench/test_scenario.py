"""Bench scenarios: the topology's `bench:` or a bench file beside it; errors with positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.base.errors import UsageError
from hgxserve.bench.scenario import bench_file_for, load_bench
from hgxserve.topology import TopologyError

REPO = Path(__file__).resolve().parents[2]
DEMO_PD = REPO / "topologies/demo/demo-pd.yml"


def _copy_topology(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "t.yml"
    path.write_text(DEMO_PD.read_text() + extra)
    return path


def _errors(exc: pytest.ExceptionInfo[TopologyError]) -> list[str]:
    return [p.text() for p in exc.value.problems]


def test_demo_bench_file_beside_the_topology() -> None:
    spec = load_bench(DEMO_PD)
    assert spec.source == str(bench_file_for(DEMO_PD))
    names = [s.name for s in spec.scenarios]
    assert len(names) >= 2 and len(set(names)) == len(names)
    for s in spec.scenarios:
        for point in s.load_points():
            assert s.warmup_for(point) >= point.concurrency


def test_inline_section_wins_and_rate_rounds(tmp_path: Path) -> None:
    path = _copy_topology(
        tmp_path,
        "bench:\n"
        "  drain_timeout_s: 5\n"
        "  scenarios:\n"
        "    - {name: steady, input: 128, output: 16, rate: [1, 2.5], max_concurrency: 8,\n"
        "       duration_s: 30, seeds: [1, 2, 3], sla: {ttft_s: 3, tpot_ms: 40}}\n",
    )
    (tmp_path / "t.bench.yaml").write_text("bench: {scenarios: [{name: other}]}\n")
    spec = load_bench(path)
    (steady,) = spec.scenarios
    assert spec.drain_timeout_s == 5
    assert [p.label for p in steady.load_points()] == ["r1-c8", "r2.5-c8"]
    assert steady.warmup_for(steady.load_points()[0]) == 8
    assert steady.requests_for(steady.load_points()[0]) is None  # timed by duration_s
    assert steady.seeds == (1, 2, 3) and steady.sla.percentile == 90
    assert steady.sla.ttft_s == 3 and steady.sla.tpot_ms == 40


def test_warmup_below_concurrency_is_an_error_at_its_position(tmp_path: Path) -> None:
    path = _copy_topology(
        tmp_path,
        "bench:\n  scenarios:\n"
        "    - {name: a, input: 100, output: 8, concurrency: [1, 8], warmup: 4}\n"
        "    - {name: a, input: 100, output: 8, concurrency: [2]}\n",
    )
    lines = len(DEMO_PD.read_text().splitlines())
    with pytest.raises(TopologyError) as exc:
        load_bench(path)
    errors = _errors(exc)
    assert any(
        e.startswith(f"{path}:{lines + 3}:")
        and "$.bench.scenarios[0].warmup" in e
        and "fewer than the concurrency 8" in e
        for e in errors
    ), errors
    assert any("$.bench.scenarios[1].name" in e and "repeats" in e for e in errors), errors


def test_bench_file_errors_name_the_bench_file(tmp_path: Path) -> None:
    path = _copy_topology(tmp_path)
    bench = tmp_path / "t.bench.yaml"
    bench.write_text(
        "bench:\n"
        "  scenarios:\n"
        "    - name: x\n"
        "      input: 0\n"
        "      output: 8\n"
        "      concurrency: [1]\n"
        "      rate: [1]\n"
        "      sla: {ttft: 3}\n"
    )
    with pytest.raises(TopologyError) as exc:
        load_bench(path)
    errors = _errors(exc)
    assert any(e.startswith(f"{bench}:4:") and "$.bench.scenarios[0].input" in e for e in errors)
    assert any("$.bench.scenarios[0].sla" in e and "ttft" in e for e in errors), errors
    assert any("$.bench.scenarios[0]" in e for e in errors)


def test_no_scenarios_says_where_to_put_them(tmp_path: Path) -> None:
    path = _copy_topology(tmp_path)
    with pytest.raises(UsageError, match=r"t\.bench\.yaml"):
        load_bench(path)


def test_unknown_scenario_name_lists_the_known_ones() -> None:
    spec = load_bench(DEMO_PD)
    with pytest.raises(UsageError, match="no scenario named nope"):
        spec.pick(["nope"])


def test_control_characters_and_unbounded_numbers_are_refused(tmp_path: Path) -> None:
    path = _copy_topology(
        tmp_path,
        'bench:\n  scenarios:\n    - {name: "a\\u0007", input: 1, output: 99999999,'
        " concurrency: [0]}\n",
    )
    with pytest.raises(TopologyError) as exc:
        load_bench(path)
    text = "\n".join(_errors(exc))
    assert "$.bench.scenarios[0].name" in text
    assert "$.bench.scenarios[0].output" in text
    assert "$.bench.scenarios[0].concurrency[0]" in text


def test_shared_prefix_and_conversations_reach_the_generator(
    tmp_path: Path, aiperf_installed: None
) -> None:
    from hgxserve.bench.generator import RoundArgs, argv

    path = _copy_topology(
        tmp_path,
        "bench:\n  scenarios:\n"
        "    - {name: chat, api: chat, input: 24, output: 8, concurrency: [4],\n"
        "       shared_prefix: {prompts: 2, tokens: 96}, conversations: {count: 6, turns: 3}}\n",
    )
    (chat,) = load_bench(path).scenarios
    assert (chat.prefix_prompts, chat.prefix_tokens) == (2, 96)
    assert (chat.conversations, chat.turns) == (6, 3)
    assert chat.to_dict()["conversations"] == {"count": 6, "turns": 3}
    cmd = argv(RoundArgs("http://p", "m", chat, chat.load_points()[0], 1, tmp_path))
    at = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("--")}
    assert at["--num-prefix-prompts"] == "2" and at["--prefix-prompt-length"] == "96"
    assert at["--conversation-num"] == "6" and at["--conversation-turn-mean"] == "3"
    assert at["--conversation-turn-stddev"] == "0"
    plain = load_bench(DEMO_PD).scenarios[0]
    assert "--num-prefix-prompts" not in argv(
        RoundArgs("http://p", "m", plain, plain.load_points()[0], 1, tmp_path)
    )


def test_conversations_need_chat_and_bounded_turns(tmp_path: Path) -> None:
    cases = {
        "{name: multi, input: 24, output: 8, concurrency: [1],"
        " conversations: {count: 2, turns: 2}}":
            "$.bench.scenarios[0].conversations: multi-turn conversations need api: chat",
        "{name: big, api: chat, input: 24, output: 8, concurrency: [1],"
        " conversations: {count: 2, turns: 65}}":
            "$.bench.scenarios[0].conversations.turns: must be <= 64",
    }  # fmt: skip
    for scenario, want in cases.items():
        path = _copy_topology(tmp_path, f"bench:\n  scenarios:\n    - {scenario}\n")
        with pytest.raises(TopologyError) as exc:
            load_bench(path)
        assert any(want in e for e in _errors(exc)), _errors(exc)
