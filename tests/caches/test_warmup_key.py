"""Warm-up of a keyed engine: the key is read from the credential the unit names (its
credentials directory, else the LoadCredential= source), sent as a Bearer token, and never
appears on a command line."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from click.testing import CliRunner
from fake_jit_engine import Handler

from hgxserve.caches.warmup import Shape, warm_up
from hgxserve.cli.release import release
from hgxserve.render import render_host
from hgxserve.topology import load_topology

KEY = "k-123"
REPO = Path(__file__).resolve().parents[2]


class _Keyed(Handler):
    """The fake engine's JSON answers, checking for one fixed key."""

    seen: list[str | None] = []

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization")
        self.seen.append(auth)
        return auth == f"Bearer {KEY}"

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._send(200, {})
        elif not self._authorized():
            self._send(401, {"error": "Unauthorized"})
        else:
            self._send(200, {"data": [{"id": "tiny"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self._authorized():
            self._send(401, {"error": "Unauthorized"})
        else:
            self._send(200, {"choices": [{"text": "x"}]})


def _server() -> tuple[ThreadingHTTPServer, str]:
    _Keyed.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Keyed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_warm_up_sends_the_key_and_fails_without_it() -> None:
    server, url = _server()
    try:
        shapes = [Shape(8, 2, 2)]
        assert warm_up(url, shapes, lambda _: None) == [f"{url}/v1/models names no model"]
        assert warm_up(url, shapes, lambda _: None, api_key=KEY) == []
        assert _Keyed.seen[-2:] == [f"Bearer {KEY}"] * 2
    finally:
        server.shutdown()


def test_wait_ready_reads_the_key_from_the_named_credential(tmp_path: Path) -> None:
    for folder in ("creds", "store"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "engine-key").write_text(KEY + "\n")
    server, url = _server()
    try:
        runner = CliRunner()
        args = ["wait-ready", f"{url}/health", "--timeout", "5", "--warmup", "8x2x1"]
        # from the unit's credentials directory when systemd gives one ...
        keyed = runner.invoke(
            release,
            [*args, "--api-key-credential", "engine-key"],
            env={"CREDENTIALS_DIRECTORY": str(tmp_path / "creds")},
        )
        assert keyed.exit_code == 0, keyed.output
        assert "warm-up done" in keyed.output
        # ... else from the LoadCredential= source path (ExecStartPost= on systemd 252)
        source = runner.invoke(
            release,
            [*args, "--api-key-credential", f"engine-key:{tmp_path / 'store' / 'engine-key'}"],
            env={"CREDENTIALS_DIRECTORY": ""},
        )
        assert source.exit_code == 0, source.output
        missing = runner.invoke(
            release,
            [*args, "--api-key-credential", f"engine-key:{tmp_path / 'nothing'}"],
            env={"CREDENTIALS_DIRECTORY": ""},
        )
        assert missing.exit_code != 0 and "engine-key" in missing.output
        assert KEY not in missing.output
        unkeyed = runner.invoke(release, args)
        assert unkeyed.exit_code != 0
    finally:
        server.shutdown()


def test_keyed_engine_unit_warms_up_with_its_credential_not_its_value() -> None:
    topo = load_topology(REPO / "topologies/demo/demo-pd.yml")
    rendered = render_host(topo, "hgx-c")
    content = next(
        f.content for p, f in rendered.files.items() if p.endswith("hgxserve-combined-0.service")
    )
    post = [line for line in content.splitlines() if line.startswith("ExecStartPost=")]
    assert len(post) == 1
    assert post[0].endswith("--api-key-credential hgxserve-engine-key")
    assert "LoadCredential=hgxserve-engine-key" in content
