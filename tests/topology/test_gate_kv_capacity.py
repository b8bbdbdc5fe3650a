"""`gate.kv_capacity`: fail by default (the schema's), warn and off as written, nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"


def _with_gate(tmp_path: Path, gate: str) -> Path:
    path = tmp_path / "pd.yml"
    path.write_text(PD.read_text() + f"gate: {gate}\n")
    return path


def test_kv_capacity_defaults_to_fail() -> None:
    assert load_topology(PD).gate.kv_capacity == "fail"


@pytest.mark.parametrize("policy", ["fail", "warn", "off"])
def test_kv_capacity_as_written(tmp_path: Path, policy: str) -> None:
    topo = load_topology(_with_gate(tmp_path, f"{{kv_capacity: {policy}}}"))
    assert topo.gate.kv_capacity == policy


def test_kv_capacity_refuses_other_values(tmp_path: Path) -> None:
    with pytest.raises(TopologyError) as err:
        load_topology(_with_gate(tmp_path, "{kv_capacity: maybe}"))
    assert "kv_capacity" in str(err.value.problems[0].text())
