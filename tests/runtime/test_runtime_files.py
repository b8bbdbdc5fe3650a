"""Topology files on the controller (local or fetched, sha256-checked) and the host-side check."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.cli.runtime import runtime
from hgxserve.runtime.files import FileSourceError, local_copy
from hgxserve.topology.model import TopologyFile

BODY = b"{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}\n"
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "t.jinja").write_bytes(BODY)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path)
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_local_source_is_used_in_place(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_bytes(BODY)
    assert local_copy(TopologyFile("t.jinja", str(path), SHA)) == path
    with pytest.raises(FileSourceError, match=f"has sha256 {SHA}, the topology pins 0+ab"):
        local_copy(TopologyFile("t.jinja", str(path), "0" * 62 + "ab"))
    with pytest.raises(FileSourceError, match="cannot read .*nope: No such file"):
        local_copy(TopologyFile("t.jinja", str(tmp_path / "nope"), SHA))


def test_url_source_is_fetched_once_and_checked(served: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    spec = TopologyFile("t.jinja", f"{served}/t.jinja", SHA)
    copy = local_copy(spec, cache)
    assert copy.read_bytes() == BODY and copy == cache / "files" / SHA / "t.jinja"
    (tmp_path / "t.jinja").write_bytes(b"changed upstream\n")
    assert local_copy(spec, cache) == copy  # cached by content: no second download
    with pytest.raises(FileSourceError, match="has sha256 .*, the topology pins"):
        local_copy(TopologyFile("t.jinja", f"{served}/t.jinja", "1" * 62 + "cd"), cache)
    with pytest.raises(FileSourceError, match="cannot fetch"):
        local_copy(TopologyFile("x", f"{served}/missing", SHA), cache)


def test_check_files_command(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_bytes(BODY)
    ok = CliRunner().invoke(runtime, ["check-files", f"{path}={SHA}"])
    assert ok.exit_code == 0 and "1 file(s) as the topology pins them" in ok.output
    bad = CliRunner().invoke(runtime, ["check-files", f"{path}={'0' * 64}", f"{path}x={SHA}"])
    assert bad.exit_code == 1
    assert f"{path}: sha256 {SHA}, expected {'0' * 64} (run the runtime stage)" in bad.output
    assert f"{path}x: No such file or directory (the runtime stage ships it)" in bad.output
    usage = CliRunner().invoke(runtime, ["check-files", "nopair"])
    assert usage.exit_code == 2
