"""CephFS in place: the units read the mount and check the marker where the weights stage wrote
it; a pinned digest (topology or `--data weights_digest=`) reaches the units."""

from __future__ import annotations

from pathlib import Path

from hgxserve.base.paths import AGENT, weights_state_dir
from hgxserve.base.units import mount_unit_name
from hgxserve.render import render_host
from hgxserve.status.report import inspect_argv
from hgxserve.topology import load_topology
from hgxserve.topology.placement import pin_digest, serving_tree

REPO = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "ab" * 32
MODEL_PATH = "\n  path: /models/DeepSeek-V3.2\n"  # model.path, not the CephFS source's path


def variant(tmp_path: Path, replace: dict[str, str]) -> Path:
    text = (REPO / "topologies/h200-dsv32-tp8.yml").read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "t.yml"
    path.write_text(text)
    return path


def unit_text(path: Path, digest: str | None = None) -> str:
    topo = pin_digest(load_topology(str(path)), digest)
    rendered = render_host(topo, "h200-a")
    (unit,) = [u for u in rendered.units if u.engine]
    return unit.content


def test_in_place_units_read_the_mount_and_its_marker(tmp_path: Path) -> None:
    path = variant(tmp_path, {"      stage: true\n": "      stage: false\n"})
    topo = load_topology(str(path))
    mount = topo.model.source.mount  # type: ignore[union-attr]
    assert serving_tree(topo.model) == (mount, weights_state_dir(topo.model.name))
    role = (REPO / "roles/weights.py").read_text()  # the weights stage writes it there
    assert "weights_state_dir(model.name)" in role
    text = unit_text(path)
    assert f"check-marker {mount} --state-dir /var/lib/hgxserve/weights/{topo.model.name}\n" in text
    assert f" serve {mount} " in text  # the engine reads the mount
    assert f"ReadOnlyPaths=-{mount}" in text


def test_staged_units_read_the_model_path(tmp_path: Path) -> None:
    topo = load_topology(str(REPO / "topologies/h200-dsv32-tp8.yml"))
    assert serving_tree(topo.model) == (topo.model.path, None)
    assert f"check-marker {topo.model.path}\n" in unit_text(REPO / "topologies/h200-dsv32-tp8.yml")


def test_a_pinned_digest_reaches_the_units(tmp_path: Path) -> None:
    pinned = variant(tmp_path, {MODEL_PATH: f"{MODEL_PATH}  digest: {DIGEST}\n"})
    assert f"--digest {DIGEST}" in unit_text(pinned)
    other = "sha256:" + "cd" * 32
    assert f"--digest {other}" in unit_text(pinned, other)  # --data weights_digest= wins
    plain = REPO / "topologies/h200-dsv32-tp8.yml"
    assert "--digest" not in unit_text(plain)
    assert f"--digest {DIGEST}" in unit_text(plain, DIGEST)


def test_in_place_engines_start_after_the_mount_and_status_reads_it(tmp_path: Path) -> None:
    path = variant(tmp_path, {"      stage: true\n": "      stage: false\n"})
    topo = load_topology(str(path))
    mount = topo.model.source.mount  # type: ignore[union-attr]
    unit = mount_unit_name(mount)
    text = unit_text(path)
    # ordered after the store and pulling it in at boot; not Requires= (a remount of a changed
    # mount unit would restart every engine outside a release)
    assert f"After=network-online.target {unit}\n" in text
    assert f"Wants=network-online.target {unit}\n" in text
    assert "Requires" not in text
    argv = inspect_argv(topo, "h200-a", AGENT)  # `hgxserve status` reads the same marker
    assert argv[argv.index("--model-path") + 1] == mount
    assert argv[argv.index("--weights-state-dir") + 1] == weights_state_dir(topo.model.name)


def test_staged_engines_do_not_wait_for_the_mount(tmp_path: Path) -> None:
    staged = REPO / "topologies/h200-dsv32-tp8.yml"
    topo = load_topology(str(staged))
    assert "After=network-online.target\n" in unit_text(staged)
    argv = inspect_argv(topo, "h200-a", AGENT)
    assert argv[argv.index("--model-path") + 1] == topo.model.path
    assert "--weights-state-dir" not in argv
