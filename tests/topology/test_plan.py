"""`hgxserve plan`: GPU map, listeners, commands, wiring, diagram; refuses invalid topologies."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.cli.topology import plan
from hgxserve.plan.diagram import topology_dot, write_diagram
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
PD = "topologies/demo/demo-pd.yml"
BIG = "topologies/h200-dsv32-2p1d.yml"
BAD = "tests/topology/invalid/pd-tp.yml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def test_plan_text_shows_gpu_map_listeners_and_wiring() -> None:
    result = CliRunner().invoke(plan, [PD])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "host hgx-a (10.77.0.11, 8 x H200)" in out
    assert "    0-3      prefill-0 (prefill)" in out
    assert "    4-7      free" in out
    assert "    8100   0.0.0.0         prefill-0 HTTP API" in out
    assert "    5600   10.77.0.11      prefill-0 NIXL side channel (dp rank 0)" in out
    assert "  proxy hgxserve on hgx-c listening 0.0.0.0:8000" in out
    assert "  prompts < 64 tokens -> combined; longer -> P/D" in out
    assert "    prefill prefill-0 on hgx-a (tp 4) http://10.77.0.11:8100 kv nixl" in out


def test_plan_json_has_every_host_in_use() -> None:
    result = CliRunner().invoke(plan, [BIG, "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert list(data["hosts"]) == ["h200-a", "h200-b", "h200-c", "h200-d", "h200-e", "h200-f"]
    gpus = data["hosts"]["h200-f"]["gpus"]
    assert {g["engine"] for g in gpus} == {"decode-0"}
    route = data["wiring"]["routes"][0]
    assert [r["name"] for r in route["prefill"]] == ["prefill-0", "prefill-1"]
    channels = route["prefill"][0]["side_channels"]
    assert [(c["host"], c["dp_rank"], c["port"]) for c in channels][3:5] == [
        ("h200-a", 3, 5603),
        ("h200-b", 4, 5604),
    ]
    assert data["warnings"] == []


def test_plan_includes_rendered_commands_when_the_renderer_is_there() -> None:
    pytest.importorskip("hgxserve.render")
    data = json.loads(CliRunner().invoke(plan, [PD, "--format", "json"]).output)
    units = data["hosts"]["hgx-a"]["units"]
    assert units and units[0]["engine"] == "prefill-0"
    assert "--tensor-parallel-size" in units[0]["argv"]


def test_plan_fails_when_the_renderer_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A topology that validates but does not render is a bug: `plan` says so and exits 6,
    never a plan with "renderer failed" in place of the units."""
    import hgxserve.render as render

    def broken(topo):  # type: ignore[no-untyped-def]
        raise render.RenderError("engine x: cannot be written")

    monkeypatch.setattr("hgxserve.plan.report.render_topology", broken)
    result = CliRunner().invoke(plan, [PD])
    assert result.exit_code == 6
    assert "renderer failed" not in result.output
    assert "not rendered: engine x: cannot be written" in result.output


def test_plan_refuses_invalid_topology_like_validate() -> None:
    result = CliRunner().invoke(plan, [BAD])
    assert result.exit_code == 1
    assert result.output == (REPO / BAD).with_suffix(".expected").read_text()
    broken = CliRunner().invoke(plan, ["tests/topology/invalid/yaml-syntax.yml"])
    assert broken.exit_code == 2


def test_diagram_dot(tmp_path: Path) -> None:
    dot = topology_dot(load_topology(REPO / PD))
    assert 'subgraph "cluster_hgx-a"' in dot
    assert '"engine/decode-0" -> "engine/prefill-0"' in dot  # the KV edge
    assert '"proxy" -> "engine/combined-0"' in dot
    result = CliRunner().invoke(plan, [PD, "--diagram", str(tmp_path / "pd.dot")])
    assert result.exit_code == 0
    assert (tmp_path / "pd.dot").read_text() == dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_diagram_svg_with_graphviz(tmp_path: Path) -> None:
    for rel in (PD, BIG):
        out = tmp_path / (Path(rel).stem + ".svg")
        assert (
            write_diagram(topology_dot(load_topology(REPO / rel)), out) == f"diagram: wrote {out}"
        )
        assert out.read_text().lstrip().startswith("<?xml")
    check = subprocess.run(
        ["dot", "-Tpng", "-o", str(tmp_path / "x.png")],
        input=topology_dot(load_topology(REPO / BIG)),
        text=True,
    )
    assert check.returncode == 0


def test_diagram_without_graphviz_writes_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hgxserve.plan.diagram.shutil.which", lambda _: None)
    message = write_diagram("digraph x {}\n", tmp_path / "x.png")
    assert "graphviz 'dot' not found" in message
    assert (tmp_path / "x.dot").read_text() == "digraph x {}\n"
    assert not (tmp_path / "x.png").exists()


def test_diagram_bad_suffix_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(plan, [PD, "--diagram", str(tmp_path / "x.jpg")])
    assert result.exit_code == 2
    assert "diagram file must end in .dot, .svg or .png" in result.output


def test_plan_shows_the_weights_integrity_and_an_opt_out(tmp_path: Path) -> None:
    result = CliRunner().invoke(plan, [PD])
    assert "weights integrity: sha256 required" in result.output
    text = (REPO / PD).read_text().replace("\nmodel:\n", "\nmodel:\n  integrity: size-etag\n", 1)
    opted = tmp_path / "opted.yml"
    opted.write_text(text)
    result = CliRunner().invoke(plan, [str(opted)])
    assert result.exit_code == 0, result.output
    assert "weights integrity: OPT-OUT" in result.output
    assert "size + ETag" in result.output
