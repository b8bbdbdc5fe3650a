"""`validate` never prints the digest of a file it refuses to ship: a `files:` source outside
the topology's folder (a key, a credential) with a wrong sha256 is named without its own
sha256, which would confirm a guess of its content offline."""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import CliRunner

from hgxserve.cli.topology import validate

REPO = Path(__file__).resolve().parents[2]
CASE = REPO / "tests/topology/invalid/file-source.yml"
WRONG = "ab" * 32


def _topology(tmp_path: Path, source: str, accept: str = "") -> Path:
    text = CASE.read_text()
    head = text[: text.index("files:\n")]
    folder = tmp_path / "topo"
    folder.mkdir(exist_ok=True)
    (folder / "template.jinja").write_text("{{ messages }}\n")
    path = folder / "t.yml"
    path.write_text(
        head + f"files:\n  template.jinja:\n    source: {source}\n    sha256: {WRONG}\n" + accept
    )
    return path


def _secret(tmp_path: Path) -> str:
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nguessable\n")
    return hashlib.sha256(secret.read_bytes()).hexdigest()


def test_a_refused_source_is_named_without_its_digest(tmp_path: Path) -> None:
    digest = _secret(tmp_path)
    for fmt in ("text", "json"):
        result = CliRunner().invoke(
            validate, [str(_topology(tmp_path, "../id_ed25519")), "--format", fmt]
        )
        assert result.exit_code == 1, result.output
        assert digest not in result.output
        assert "lies outside the topology's folder" in result.output
        assert f"does not have sha256 {WRONG} (its own digest is not shown" in result.output


def test_an_accepted_or_local_source_still_shows_its_digest(tmp_path: Path) -> None:
    digest = _secret(tmp_path)
    accept = "accept: {'$.files[\"template.jinja\"].source': the lab's shared key}\n"
    result = CliRunner().invoke(validate, [str(_topology(tmp_path, "../id_ed25519", accept))])
    assert f"has sha256 {digest}, not {WRONG}" in result.output, result.output
    local = hashlib.sha256(b"{{ messages }}\n").hexdigest()
    result = CliRunner().invoke(validate, [str(_topology(tmp_path, "template.jinja"))])
    assert f"has sha256 {local}, not {WRONG}: set sha256: {local}" in result.output
