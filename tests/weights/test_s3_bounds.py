"""Every S3 answer is bounded: a body over its kind's bound, a huge Content-Length, an endless
chunked page or a trickled body ends within a bounded time and memory, with a clear
SourceError, never a MemoryError, a traceback or a hang. Served by a raw socket server that
answers as a hostile or broken store would."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from hgxserve.weights import s3
from hgxserve.weights.errors import SourceError
from hgxserve.weights.s3 import S3Options, make_client

Answer = Callable[[socket.socket], None]


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk


@pytest.fixture()
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Answer]]:
    """{'answer': fn(conn)}: how the store answers each request (after reading it)."""
    box: dict[str, Answer] = {}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                _read_request(conn)
                box["answer"](conn)
            except OSError:
                pass  # the client gave up on us: what the bounds are for

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    yield box
    stop.set()
    listener.close()


def _client() -> s3.S3Client:
    return make_client("models", S3Options(addressing="path", retries=0))


def _endless_chunked(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n")
    conn.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"<ListBucketResult>" + b"x" * 65000
    while True:
        conn.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")


def test_endless_chunked_listing_page_stops_at_its_bound(
    store: dict[str, Answer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "LIST_PAGE_MAX", 2 << 20)
    store["answer"] = _endless_chunked
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(SourceError, match="longer than the 2097152-byte bound for a listing page"):
        list(_client().list_objects("m/"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - started < 30
    assert peak < 16 << 20  # the page bound, not what the store sent


def test_huge_content_length_is_refused_before_reading(store: dict[str, Answer]) -> None:
    def huge(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 107374182400\r\n\r\n{")
        time.sleep(5)

    store["answer"] = huge
    started = time.monotonic()
    with pytest.raises(SourceError, match="announces 107374182400 bytes, over the"):
        _client().get_bytes("m/manifest.json")
    assert time.monotonic() - started < 4


def _trickle(status: bytes, length: int) -> Answer:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 " + status + f"\r\nContent-Length: {length}\r\n\r\n".encode())
        for _ in range(length):
            conn.sendall(b"x")
            time.sleep(0.3)

    return answer


def test_trickled_small_object_ends_at_the_request_budget(
    store: dict[str, Answer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "REQUEST_BASE_S", 1.5)
    monkeypatch.setattr(s3, "MIN_RATE", 1 << 40)  # the size adds nothing: the base alone
    store["answer"] = _trickle(b"200 OK", 1000)  # 300 s at this pace; every recv gets a byte
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"no complete answer within 2s"):
        _client().get_bytes("m/config.json")
    assert time.monotonic() - started < 6


def test_trickled_ranged_get_ends_at_the_request_budget(
    store: dict[str, Answer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "REQUEST_BASE_S", 1.5)
    monkeypatch.setattr(s3, "MIN_RATE", 1 << 40)
    store["answer"] = _trickle(b"206 Partial Content", 64)
    buf = memoryview(bytearray(64))
    started = time.monotonic()
    with pytest.raises(SourceError, match="no complete answer within"):
        _client().get_range_into("m/a.safetensors", 0, buf, None)
    assert time.monotonic() - started < 6


def _stall(conn: socket.socket) -> None:
    time.sleep(30)  # accepts, reads the request, never answers


def test_a_request_and_its_retries_end_at_the_request_deadline(
    store: dict[str, Answer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each attempt is cut at its own budget, but 8 retries of it (at 92 s for a 32 MiB part,
    # plus backoffs) kept one request going for ~11 min: all of them end at the deadline.
    monkeypatch.setattr(s3, "REQUEST_BASE_S", 1.0)
    monkeypatch.setattr(s3, "MIN_RATE", 1 << 40)
    store["answer"] = _stall
    client = make_client("models", S3Options(addressing="path", retries=8, request_deadline_s=2.5))
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"attempts in \ds \(the request deadline, 2s\)"):
        client.get_range_into("m/a.safetensors", 0, memoryview(bytearray(64)), None)
    assert time.monotonic() - started < 4.0


def test_the_request_deadline_is_at_least_one_attempts_budget() -> None:
    from hgxserve.base.defaults import S3_REQUEST_DEADLINE_S

    part = s3.S3Call("GET", "k", into=memoryview(bytearray(32 << 20)))
    assert part.deadline_s(S3_REQUEST_DEADLINE_S) == 300.0 > part.budget_s() * 3
    big = s3.S3Call("GET", "k", into=memoryview(bytearray(512 << 20)))
    assert big.deadline_s(S3_REQUEST_DEADLINE_S) == big.budget_s() == 60 + 512
    assert S3Options().request_deadline_s == S3_REQUEST_DEADLINE_S


def test_budget_grows_with_the_size_at_the_minimum_rate() -> None:
    part = s3.S3Call("GET", "k", into=memoryview(bytearray(4 << 20)))
    assert part.budget_s() == s3.REQUEST_BASE_S + (4 << 20) / s3.MIN_RATE
    assert s3.S3Call("HEAD", "k").budget_s() == s3.REQUEST_BASE_S
    page = s3.S3Call("GET", None, limit=s3.LIST_PAGE_MAX)
    assert page.budget_s() == s3.REQUEST_BASE_S + s3.LIST_PAGE_MAX / s3.MIN_RATE


def test_listing_pages_together_are_bounded(
    store: dict[str, Answer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "LIST_TOTAL_MAX", 1 << 20)
    count = {"n": 0}

    def page(conn: socket.socket) -> None:
        count["n"] += 1
        items = "".join(
            f"<Contents><Key>m/{count['n']}-{i:04d}-{'k' * 200}</Key><Size>1</Size></Contents>"
            for i in range(1000)
        )
        body = (
            f"<ListBucketResult>{items}<IsTruncated>true</IsTruncated>"
            f"<NextContinuationToken>t{count['n']}</NextContinuationToken></ListBucketResult>"
        ).encode()
        conn.sendall(
            f"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    store["answer"] = page
    with pytest.raises(SourceError, match="more than 1 MiB of listing"):
        list(_client().list_objects("m/"))
    assert count["n"] < 10


def test_endless_error_body_is_cut_and_the_status_reported(store: dict[str, Answer]) -> None:
    def endless_error(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            conn.sendall(b"ffff\r\n" + b"y" * 0xFFFF + b"\r\n")

    store["answer"] = endless_error
    started = time.monotonic()
    with pytest.raises(Exception, match="HTTP 403"):
        _client().get_bytes("m/config.json")
    assert time.monotonic() - started < 10
