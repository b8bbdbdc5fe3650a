"""A hostile or broken S3 listing is a clear SourceError: never a hang, a traceback or a
reservation of absurd sizes. Served by a small local HTTP server speaking ListObjectsV2."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hgxserve.weights.errors import SourceError, VerifyError
from hgxserve.weights.manifest import Manifest, ManifestFile
from hgxserve.weights.s3 import S3Options, make_client

NS = "http://s3.amazonaws.com/doc/2006-03-01/"


def _page(contents: list[tuple[str, str]], token: str | None = None) -> bytes:
    items = "".join(
        f"<Contents><Key>{k}</Key><Size>{s}</Size><ETag>&quot;e&quot;</ETag></Contents>"
        for k, s in contents
    )
    more = (
        f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>"
        if token
        else "<IsTruncated>false</IsTruncated>"
    )
    return f'<ListBucketResult xmlns="{NS}">{items}{more}</ListBucketResult>'.encode()


@pytest.fixture()
def listing(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bytes]]:
    """{'body': ...}: what every ListObjectsV2 answers; yields before the server stops."""
    answer: dict[str, bytes] = {"body": _page([])}
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            requests.append(self.path)
            body = answer["body"]
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
    answer["requests"] = requests  # type: ignore[assignment]
    yield answer
    server.shutdown()
    server.server_close()


def _list() -> list[object]:
    client = make_client("models", S3Options(addressing="path", retries=0))
    return list(client.list_objects("m/"))


def test_sane_listing(listing: dict[str, bytes]) -> None:
    listing["body"] = _page([("m/config.json", "12")])
    assert [(o.key, o.size) for o in _list()] == [("m/config.json", 12)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("size", ["-1", str(6 << 40), "12abc", ""])
def test_size_out_of_bounds_is_refused(listing: dict[str, bytes], size: str) -> None:
    listing["body"] = _page([("m/a.safetensors", size)])
    with pytest.raises(SourceError, match="size"):
        _list()


def test_repeated_continuation_token_stops(listing: dict[str, bytes]) -> None:
    listing["body"] = _page([("m/a", "1")], token="same-token")
    with pytest.raises(SourceError, match="again"):
        _list()
    assert len(listing["requests"]) == 2  # the first page, the repeat: then it stops


def test_xml_error_is_a_clear_error(listing: dict[str, bytes]) -> None:
    listing["body"] = b"<ListBucketResult><Contents><Key>m/a"
    with pytest.raises(SourceError, match="not valid XML"):
        _list()


@pytest.mark.parametrize("size", [-1, 6 << 40])
def test_manifest_sizes_are_bounded(size: int) -> None:
    with pytest.raises(VerifyError, match="size"):
        Manifest(files=[ManifestFile("a.bin", size, "0" * 64)])


@pytest.mark.parametrize("path", ["a\nb", "../x", "/etc/passwd", "a\\..\\b"])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(VerifyError, match="unsafe path"):
        Manifest(files=[ManifestFile(path, 1, "0" * 64)])


@pytest.mark.parametrize(
    "user, secret", [("models,rw", "/etc/s"), ("models", "/etc/s,rw"), ("m=x", "/etc/s")]
)
def test_cephfs_mount_values_cannot_add_options(user: str, secret: str) -> None:
    from hgxserve.weights.cephfs import mount_unit

    with pytest.raises(ValueError, match="may not hold"):
        mount_unit(["10.0.0.1:6789"], "/models", user, secret, "/mnt/m")
    with pytest.raises(ValueError, match="control character"):
        mount_unit(["10.0.0.1:6789"], "/models\nExecStartPre=/bin/sh", "m", "/etc/s", "/mnt/m")
