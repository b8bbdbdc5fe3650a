"""Matrix expansion over a base topology, and pruning through validate + the fit estimate."""

from __future__ import annotations

from pathlib import Path

import yaml

from hgxserve.topology import check_topology
from hgxserve.tune import matrix, prune

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
DSV32 = REPO / "topologies/h200-dsv32-tp8.yml"


def test_combinations_in_written_order() -> None:
    combos = matrix.combinations(
        {"prefill": {"tp": [2, 4], "count": [1, 2]}, "decode": {"max_num_seqs": [8]}}
    )
    assert [matrix.label(c) for c in combos] == [
        "prefill tp=2 count=1; decode max_num_seqs=8",
        "prefill tp=2 count=2; decode max_num_seqs=8",
        "prefill tp=4 count=1; decode max_num_seqs=8",
        "prefill tp=4 count=2; decode max_num_seqs=8",
    ]


def test_expanded_candidates_are_written_placed_wired_and_valid(tmp_path: Path) -> None:
    written = matrix.expand(
        PD, {"prefill": {"tp": [2], "count": [1, 2]}, "decode": {"max_num_seqs": [4]}}, tmp_path
    )
    assert [(p.name, lab) for p, lab in written] == [
        ("demo-pd-m00.yml", "prefill tp=2 count=1; decode max_num_seqs=4"),
        ("demo-pd-m01.yml", "prefill tp=2 count=2; decode max_num_seqs=4"),
    ]
    two = yaml.safe_load(written[1][0].read_text())
    assert two["name"] == "demo-pd-m01" and "baseline" not in two
    engines = two["engines"]
    assert set(engines) == {"prefill-0", "prefill-1", "decode-0", "combined-0"}
    # the combined engine keeps hgx-c; new prefills take free GPUs in host order
    assert engines["prefill-0"]["place"] == {"hgx-a": [0, 1]}
    assert engines["prefill-1"]["place"] == {"hgx-a": [2, 3]}
    assert engines["prefill-1"]["port"] == 8101
    assert engines["prefill-1"]["kv"]["side_channel"]["port"] == 5601
    # the decode (TP4) fits beside them on hgx-a: its ports move past theirs
    assert engines["decode-0"]["place"] == {"hgx-a": [4, 5, 6, 7]}
    assert engines["decode-0"]["port"] == 8200
    assert engines["decode-0"]["kv"]["side_channel"]["port"] == 5602
    assert engines["decode-0"]["args"]["max_num_seqs"] == 4
    assert two["proxy"]["routes"] == [
        {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0"]}
    ]
    assert two["proxy"]["combined"] == ["combined-0"]
    # the base's bench file is beside each candidate
    assert (tmp_path / "demo-pd-m01.bench.yaml").read_text() == PD.with_name(
        "demo-pd.bench.yaml"
    ).read_text()
    for path, _ in written:
        result = check_topology(path)
        assert result.errors == [], [p.text() for p in result.errors]


def test_a_combination_that_cannot_be_placed_is_pruned_with_its_reason(tmp_path: Path) -> None:
    written = matrix.expand(PD, {"prefill": {"tp": [8], "count": [3]}}, tmp_path)
    checked = prune.check(written[0][0])
    assert checked.pruned
    assert any("GPU" in r or "gpu" in r for r in checked.reasons), checked.reasons


def test_a_relative_model_config_still_points_at_the_same_file(tmp_path: Path) -> None:
    (path, _), *_ = matrix.expand(DSV32, {"combined": {"max_num_seqs": [64]}}, tmp_path)
    config = yaml.safe_load(path.read_text())["model"]["config"]
    assert Path(config).is_absolute()
    assert Path(config) == (DSV32.parent / "models/DeepSeek-V3.2/config.json").resolve()


def test_the_fit_estimate_prunes_with_every_reason(tmp_path: Path) -> None:
    """DeepSeek-V3.2 at TP2 on H200: the weights do not fit; TP8 (the seed's) survives."""
    written = matrix.expand(DSV32, {"combined": {"tp": [2, 8]}}, tmp_path)
    small, full = (prune.check(p) for p, _ in written)
    assert small.pruned and not full.pruned, full.reasons
    assert any(
        "weights alone take" in r and "$.engines" in r and r.endswith("(rule fit-weights)")
        for r in small.reasons
    )
    assert all(r.startswith(str(written[0][0])) for r in small.reasons)


def test_the_fit_estimate_alone_prunes_what_no_rule_reported(tmp_path: Path, monkeypatch) -> None:
    from hgxserve.topology import fit

    real = fit.EngineFit.status

    monkeypatch.setattr(fit.EngineFit, "status", property(lambda self: "no-fit"))
    checked = prune.check(DSV32)
    monkeypatch.setattr(fit.EngineFit, "status", real)
    assert any(r.startswith("fit estimate: ") and "no-fit" in r for r in checked.reasons)


def test_a_base_without_the_role_is_a_usage_error(tmp_path: Path) -> None:
    import pytest

    from hgxserve.base.errors import UsageError

    with pytest.raises(UsageError, match="no prefill engine"):
        matrix.expand(DSV32, {"prefill": {"tp": [2]}}, tmp_path)
