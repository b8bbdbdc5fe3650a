"""Release ids and release file paths are checked before they become paths on the host."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.cli.release import release
from hgxserve.release.store import ReleaseError, ReleaseSpec, Store, UnitSpec

HOSTILE = ["../../etc", "a/b", "..", "", "3f1c\nrm", ".hidden", "x" * 65]


@pytest.mark.parametrize("release_id", HOSTILE)
def test_hostile_release_ids_are_refused(tmp_path: Path, release_id: str) -> None:
    store = Store(str(tmp_path))
    with pytest.raises(ReleaseError, match="not a release id"):
        store.release_dir(release_id)
    with pytest.raises(ReleaseError, match="not a release id"):
        store.set_link("current", release_id)
    assert not (tmp_path / "current").exists()


@pytest.mark.parametrize("command", ["switch", "confirm", "revert", "gate"])
def test_cli_refuses_a_hostile_id_without_a_traceback(tmp_path: Path, command: str) -> None:
    result = CliRunner().invoke(release, [command, "../../etc", "--root", str(tmp_path)])
    assert result.exit_code != 0
    assert "not a release id" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def _spec(**changes: object) -> ReleaseSpec:
    spec = ReleaseSpec(
        id="3f1c9a2b7d10",
        topology="t",
        topology_digest="d",
        baseline=False,
        host="h",
        units=[UnitSpec("hgxserve-x.service", "engine")],
        files={"/etc/systemd/system/hgxserve-x.service": 0o644},
    )
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def test_release_json_with_a_hostile_id_or_path_is_refused() -> None:
    assert ReleaseSpec.from_json(_spec().to_json()).id == "3f1c9a2b7d10"
    with pytest.raises(ReleaseError, match="not a release id"):
        ReleaseSpec.from_json(_spec(id="../x").to_json())
    with pytest.raises(ReleaseError, match="not a plain absolute path"):
        ReleaseSpec.from_json(_spec(files={"/etc/../root/.ssh/authorized_keys": 0o600}).to_json())
