"""The tune SPEC: checked like a topology, every error with file:line:col and its JSON path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.topology import TopologyError
from hgxserve.tune.spec import DEFAULT_STAGES, MAX_CANDIDATES, load_spec

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "topologies/demo"


def write(tmp_path: Path, text: str) -> Path:
    for name in ("demo-baseline.yml", "demo-pd.yml", "demo-pd.bench.yaml"):
        (tmp_path / name).write_text((DEMO / name).read_text())
    path = tmp_path / "t.tune.yaml"
    path.write_text(text)
    return path


def errors(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(TopologyError) as exc:
        load_spec(write(tmp_path, text))
    return [p.text() for p in exc.value.problems]


def test_a_candidate_list(tmp_path: Path) -> None:
    spec = load_spec(
        write(
            tmp_path,
            "base: demo-pd.yml\ncandidates: [demo-pd.yml, demo-baseline.yml]\n"
            "sla: {ttft_s: 2, tpot_ms: 30}\nleave: baseline\nbaseline: demo-baseline.yml\n",
        )
    )
    assert spec.base == tmp_path / "demo-pd.yml"
    assert spec.candidates == (tmp_path / "demo-pd.yml", tmp_path / "demo-baseline.yml")
    assert spec.sla == {"ttft_s": 2, "tpot_ms": 30}
    assert spec.leave == "baseline" and spec.baseline_file == tmp_path / "demo-baseline.yml"
    assert spec.stages == DEFAULT_STAGES and spec.inventory is None
    assert len(spec.digest) == 64


def test_defaults_leave_the_best_and_the_base_is_the_baseline(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "base: demo-pd.yml\nmatrix: {prefill: {tp: [2, 4]}}\n"))
    assert spec.leave == "best" and spec.baseline_file == spec.base
    assert spec.matrix == {"prefill": {"tp": [2, 4]}}


def test_every_error_has_its_position_and_path(tmp_path: Path) -> None:
    found = errors(
        tmp_path,
        "base: demo-pd.yml\n"
        "candidates: [demo-pd.yml]\n"
        "leave: worst\n"
        "sla: {ttft_s: 0}\n"
        "deploy: {stages: [engines, lunch]}\n"
        "colour: blue\n",
    )
    text = "\n".join(found)
    assert len(found) >= 4, text
    assert f"{tmp_path}/t.tune.yaml:3:8: $.leave:" in text
    assert f"{tmp_path}/t.tune.yaml:4:15: $.sla.ttft_s:" in text
    assert "$.deploy.stages[1]:" in text
    assert "colour" in text


def test_numbers_are_bounded(tmp_path: Path) -> None:
    text = "\n".join(
        errors(
            tmp_path, "base: demo-pd.yml\nmatrix: {decode: {tp: [0, 65], max_num_seqs: [70000]}}\n"
        )
    )
    assert "$.matrix.decode.tp[0]:" in text and "$.matrix.decode.tp[1]:" in text
    assert "$.matrix.decode.max_num_seqs[0]:" in text


def test_candidates_or_matrix_not_both_nor_neither(tmp_path: Path) -> None:
    assert errors(tmp_path, "base: demo-pd.yml\n")
    assert errors(
        tmp_path, "base: demo-pd.yml\ncandidates: [demo-pd.yml]\nmatrix: {decode: {tp: [2]}}\n"
    )


def test_missing_files_are_named_where_written(tmp_path: Path) -> None:
    found = errors(tmp_path, "base: demo-pd.yml\ncandidates: [demo-pd.yml, nope.yml]\n")
    assert found == [
        f"{tmp_path}/t.tune.yaml:2:27: $.candidates[1]: nope.yml: no such file "
        f"({tmp_path}/nope.yml)"
    ]


def test_a_matrix_too_large_is_refused(tmp_path: Path) -> None:
    values = list(range(1, 9))
    (found,) = errors(
        tmp_path,
        f"base: demo-pd.yml\nmatrix: {{prefill: {{tp: {values}, count: {values}}}, "
        "decode: {max_num_seqs: [8, 16]}}\n",
    )
    assert "expands to 128 candidates" in found and str(MAX_CANDIDATES) in found


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    found = errors(tmp_path, "base: demo-pd.yml\nbase: demo-pd.yml\ncandidates: [demo-pd.yml]\n")
    assert any(":2:1:" in f for f in found), found


def test_deploy_data_goes_to_pyinfra_one_argv_word_each_never_a_shell(tmp_path: Path) -> None:
    from hgxserve.tune.loop import SITE, deploy_argv

    spec = load_spec(
        write(
            tmp_path,
            "base: demo-pd.yml\ncandidates: [demo-pd.yml]\n"
            "deploy: {stages: [engines], data: {health_timeout: 900, confirm_within: '300'}}\n",
        )
    )
    argv = deploy_argv(spec, tmp_path / "demo-pd.yml", Path("/inv/lab.py"))
    assert argv[1:4] == ["-y", "/inv/lab.py", str(SITE)]
    assert argv[4:] == [
        "--data", f"topology={(tmp_path / 'demo-pd.yml').resolve()}",
        "--data", "stages=engines",
        "--data", "health_timeout=900",
        "--data", "confirm_within=300",
    ]  # fmt: skip
    assert errors(
        tmp_path, "base: demo-pd.yml\ncandidates: [demo-pd.yml]\ndeploy: {data: {'a b': 1}}\n"
    )
    # shell syntax in a tunable key's value is refused when the SPEC is read, at its position
    found = errors(
        tmp_path,
        "base: demo-pd.yml\ncandidates: [demo-pd.yml]\n"
        "deploy: {data: {health_timeout: '1; rm -rf / $(reboot)'}}\n",
    )
    assert len(found) == 1 and "$.deploy.data.health_timeout" in found[0], found
    assert "not a number" in found[0]


# What the inventory owns: trust (env secrets, pins, digests), sources, hosts, the topology.
_INVENTORYS = {
    "allow_env": "AWS_SECRET_ACCESS_KEY",
    "model_pins": "/tmp/pins.yml",
    "weights_digest": "sha256:" + "0" * 64,
    "apt_source": "deb http://evil/ x main",
    "runtime_index_url": "http://evil/simple",
    "runtime_index_unpinned": True,
    "ssh_hostname": "10.9.9.9",
    "ssh_strict_host_key_checking": "no",
    "topology": "/tmp/other.yml",
    "stages": "provision",
    "nccl_mpirun": "/tmp/x",
    "bench_tokenizer": "/x",
    "confirm": True,  # no key at all
}


@pytest.mark.parametrize("key", sorted(_INVENTORYS))
def test_a_spec_sets_only_the_tunable_data_keys(tmp_path: Path, key: str) -> None:
    value = _INVENTORYS[key]
    text = value if isinstance(value, bool) else repr(value)
    spec = "base: demo-pd.yml\ncandidates: [demo-pd.yml]\ndeploy:\n  data:\n"
    found = errors(tmp_path, f"{spec}    health_timeout: 900\n    {key}: {text}\n")
    assert len(found) == 1, found
    assert f":6:{7 + len(key)}: $.deploy.data.{key}: {key}: a tune SPEC may not set it" in found[0]
    assert "confirm_within, health_timeout" in found[0]


def test_a_tune_spec_built_past_the_loader_is_refused_too(tmp_path: Path) -> None:
    from hgxserve.base.errors import UsageError
    from hgxserve.tune.loop import deploy_argv
    from hgxserve.tune.spec import TuneSpec

    spec = TuneSpec(file="x", digest="0", base=tmp_path, data={"allow_env": "AWS_SECRET"})
    with pytest.raises(UsageError, match="allow_env: a tune SPEC may not set it"):
        deploy_argv(spec, tmp_path / "t.yml", Path("/inv/lab.py"))


def test_the_shipped_tune_spec_sets_only_tunable_keys() -> None:
    from hgxserve.deploy.data import TABLE, TUNABLE

    spec = load_spec(DEMO / "demo.tune.yaml")
    assert set(spec.data) <= set(TUNABLE)
    assert all(TABLE[name].tunable for name in TUNABLE)


def test_the_command_dry_run_prunes_and_estimates_without_deploying() -> None:
    from click.testing import CliRunner

    from hgxserve.cli.tune import tune

    result = CliRunner().invoke(tune, [str(DEMO / "demo.tune.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "keep   demo-pd-m00 (demo-pd-m00.yml)"
    assert "pruned demo-pd-m02 (demo-pd-m02.yml)" in lines
    assert any("is already used by prefill-0" in line for line in lines)
    assert any(line.startswith("estimated wall time: ") for line in lines)


def test_the_command_exits_2_on_a_bad_spec_or_no_inventory(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hgxserve.cli.tune import tune

    bad = write(tmp_path, "base: demo-pd.yml\ncandidates: [demo-pd.yml]\nleave: worst\n")
    result = CliRunner().invoke(tune, [str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:3:8: $.leave:" in result.output
    bare = write(tmp_path, "base: demo-pd.yml\ncandidates: [demo-pd.yml]\n")
    result = CliRunner().invoke(tune, [str(bare)])
    assert result.exit_code == 2 and "no inventory" in result.output
