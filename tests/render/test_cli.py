"""`hgxserve render FILE --out DIR [--host NAME]`."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

from conftest import ROOT

HGXSERVE = str(ROOT / ".venv" / "bin" / "hgxserve")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HGXSERVE, *args], cwd=ROOT, capture_output=True, text=True)


def test_render_writes_the_host_tree(tmp_path: Path):
    done = run("render", "topologies/h20-v4flash-4p4d.yml", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [
        "h20-a/.hgxserve-render.json",
        "h20-a/etc/hgxserve/firewall.nft",  # VLLM_PORT 20000, 30000 bind 0.0.0.0
        "h20-a/etc/hgxserve/proxy.json",
        "h20-a/etc/systemd/system/hgxserve-decode-0.service",
        "h20-a/etc/systemd/system/hgxserve-prefill-0.service",
        "h20-a/etc/systemd/system/hgxserve-proxy.service",
    ]
    unit = tmp_path / "h20-a/etc/systemd/system/hgxserve-decode-0.service"
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert done.stdout.startswith("h20-a  3 units  5 files  tree ")


def test_rerender_removes_files_it_no_longer_renders(tmp_path: Path):
    assert run("render", "topologies/h20-v4flash-4p4d.yml", "--out", str(tmp_path)).returncode == 0
    mine = tmp_path / "h20-a/etc/notes.txt"
    mine.write_text("kept: not rendered by hgxserve")
    assert run("render", "topologies/h20-v4flash-tp8.yml", "--out", str(tmp_path)).returncode == 0
    units = sorted(p.name for p in (tmp_path / "h20-a/etc/systemd/system").iterdir())
    assert units == ["hgxserve-combined-0.service", "hgxserve-proxy.service"]
    assert mine.exists()


def test_invalid_topology_prints_validate_lines_and_exits_1(tmp_path: Path):
    bad = tmp_path / "bad.yml"
    text = (ROOT / "topologies/h20-v4flash-4p4d.yml").read_text()
    bad.write_text(text.replace("place: {h20-a: [4, 5, 6, 7]}", "place: {h20-a: [3, 4, 5, 6]}"))
    done = run("render", str(bad), "--out", str(tmp_path / "out"))
    assert done.returncode == 1
    assert f"{bad}:" in done.stderr and "$.engines.decode-0.place" in done.stderr
    assert "not rendered" in done.stderr
    assert not (tmp_path / "out").exists()


def test_one_host_and_unknown_host(tmp_path: Path):
    topo = "tests/render/topologies/sglang-pd-image.yml"
    done = run("render", topo, "--out", str(tmp_path), "--host", "h20-b")
    assert done.returncode == 0 and [p.name for p in tmp_path.iterdir()] == ["h20-b"]
    done = run("render", topo, "--out", str(tmp_path), "--host", "h20-z")
    assert done.returncode == 2 and "host 'h20-z' is not in" in done.stderr
    assert "Traceback" not in done.stderr
