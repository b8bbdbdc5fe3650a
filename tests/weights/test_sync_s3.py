"""`hgxserve weights sync/verify/check-marker` against a real local S3 server (moto)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from weights_helpers import (
    SECRET_KEY,
    VENV_BIN,
    Bucket,
    Fault,
    Run,
    boto_client,
    free_port,
    hgx,
    model_files,
    small_tmpfs,
    sync_through,
    tree,
    upload,
)
from weights_s3proxy import ProxyState

# these objects carry no S3 checksum and most cases publish no manifest: they test the transfer,
# so they opt out of the sha256 requirement explicitly (test_sha256_required_by_default checks it)
# (and are not whole checkpoints: test_incomplete_model_is_not_marked checks completeness)
PART = [
    *("--part-size", "1MiB", "--concurrency", "4", "-q"),
    *("--allow-size-etag", "--allow-incomplete"),
]
PARTIAL_TREE = ["--allow-incomplete"]


def endpoint(port: int) -> list[str]:
    return ["--endpoint-url", f"http://127.0.0.1:{port}", "--addressing", "path"]


def part_sync(env: dict[str, str], src: str, dest: Path, port: int, *extra: str) -> Run:
    """`weights sync SRC DEST` against the S3 at `port`, with the PART options."""
    return hgx(env, "sync", src, str(dest), *endpoint(port), *PART, *extra)


def uploaded_model(
    bucket: Bucket, tmp_path: Path, name: str, seed: int
) -> tuple[dict[str, bytes], str, Path]:
    """`model_files(seed)` uploaded under `name/`, the s3:// URL of that prefix, a DEST for it."""
    files = model_files(seed)
    upload(bucket, f"{name}/", files)
    return files, f"s3://{bucket.name}/{name}/", tmp_path / name


def synced_model(
    bucket: Bucket, env: dict[str, str], tmp_path: Path, name: str, seed: int
) -> tuple[dict[str, bytes], str, Path]:
    """`uploaded_model`, synced into its DEST (which succeeds)."""
    files, src, dest = uploaded_model(bucket, tmp_path, name, seed)
    assert part_sync(env, src, dest, bucket.port).rc == 0
    return files, src, dest


def test_full_sync_then_noop_resync_reads_no_object_data(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files, src, dest = uploaded_model(bucket, tmp_path, "tiny", 1)
    port, seen = proxy

    first = part_sync(aws_env, src, dest, port, "--json")
    assert first.rc == 0, first.text
    assert tree(dest) == files
    report = json.loads(first.out)
    assert report["fetched"] == len(files) and report["marker"] is True
    # 3 MiB + 2 MiB shards in 1 MiB parts, plus one GET per non-empty small file.
    assert len(seen.object_gets()) == 4 + 3 + 3
    marker = (dest / ".hgxserve" / "verified").read_text().strip()
    assert marker == report["manifest_digest"]

    seen.reset()
    again = part_sync(aws_env, src, dest, port, "--json")
    assert again.rc == 0, again.text
    assert json.loads(again.out)["unchanged"] == len(files)
    assert seen.object_gets() == []
    assert [s.method for s in seen.seen] == ["GET"]  # the listing, nothing else
    assert "list-type=2" in seen.seen[0].path
    assert (dest / ".hgxserve" / "verified").read_text().strip() == marker
    assert hgx(aws_env, "check-marker", str(dest), "--digest", marker).rc == 0


def test_published_manifest_then_flipped_byte_in_object_fails_naming_the_file(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    files, src, dest = uploaded_model(bucket, tmp_path, "m", 2)
    built = hgx(aws_env, "manifest", src, *endpoint(bucket.port), "--publish")
    assert built.rc == 0, built.text
    manifest = json.loads(
        boto_client(bucket.port)
        .get_object(Bucket=bucket.name, Key="m/hgxserve-manifest.json")["Body"]
        .read()
    )
    digest = manifest["digest"]
    shard = "model-00002-of-00002.safetensors"
    flipped = bytearray(files[shard])
    flipped[1_500_000] ^= 0x01
    bucket.put("m/" + shard, bytes(flipped))

    run = part_sync(aws_env, src, dest, bucket.port)
    assert run.rc == 1, run.text
    assert shard in run.err and "does not match the manifest" in run.err
    assert not (dest / shard).exists()  # no corrupt file kept
    assert not (dest / (shard + ".partial")).exists()
    assert not (dest / ".hgxserve" / "verified").exists()
    check = hgx(aws_env, "check-marker", str(dest), "--digest", digest)
    assert check.rc == 1 and "not verified" in check.err
    # The other files did arrive and are recorded, so fixing the object costs one file.
    bucket.put("m/" + shard, files[shard])
    fixed = part_sync(aws_env, src, dest, bucket.port, "--json")
    assert fixed.rc == 0, fixed.text
    assert json.loads(fixed.out)["fetched"] == 1
    assert hgx(aws_env, "check-marker", str(dest), "--digest", digest).rc == 0


def test_s3_checksum_used_without_manifest_and_reported(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    bucket.put("c/with.bin", os.urandom(100_000), ChecksumAlgorithm="SHA256")
    bucket.put("c/without.bin", os.urandom(100_000))
    run = part_sync(aws_env, f"s3://{bucket.name}/c/", tmp_path / "c", bucket.port, "--json")
    assert run.rc == 0, run.text
    assert json.loads(run.out)["verified_by"] == {"s3-checksum": 1, "none": 1}
    assert "1 by sha256 against the S3 object checksum" in run.err
    assert "1 by size + ETag only" in run.err
    state = json.loads((tmp_path / "c" / ".hgxserve" / "state.json").read_text())
    assert state["files"]["with.bin"]["verified_by"] == "s3-checksum"
    strict = part_sync(
        aws_env, f"s3://{bucket.name}/c/", tmp_path / "c2", bucket.port, "--require-sha256"
    )
    assert strict.rc == 1 and "without.bin" in strict.err
    assert not (tmp_path / "c2" / ".hgxserve" / "verified").exists()


def test_kill_mid_download_then_resume(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    data = os.urandom(8 * 1024 * 1024)
    bucket.put("big/shard.safetensors", data, ChecksumAlgorithm="SHA256")  # sha256 by default
    port, seen = proxy
    seen.faults.get_delay = 0.4
    dest = tmp_path / "big"
    partial = dest / "shard.safetensors.partial"
    parts_log = dest / "shard.safetensors.partial.parts"
    args = ["sync", f"s3://{bucket.name}/big/", str(dest), *endpoint(port)]
    args += ["--part-size", "1MiB", "--concurrency", "2", "-q", "--allow-incomplete"]
    proc = subprocess.Popen(
        [str(VENV_BIN / "hgxserve"), "weights", *args],
        env=aws_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if parts_log.exists() and len(parts_log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial.exists() and not (dest / "shard.safetensors").exists()
    done_before = len(parts_log.read_text().splitlines()) - 1
    assert 2 <= done_before < 8

    seen.reset()
    resumed = hgx(aws_env, *args, "--json")
    assert resumed.rc == 0, resumed.text
    report = json.loads(resumed.out)
    assert report["bytes_resumed"] >= done_before * 1024 * 1024
    assert len(seen.object_gets()) <= 8 - done_before
    assert (dest / "shard.safetensors").read_bytes() == data
    assert not partial.exists() and not parts_log.exists()
    full = hgx(aws_env, "verify", str(dest), "--full", "-q", *PARTIAL_TREE)
    assert full.rc == 0, full.text


def test_corrupted_partial_after_crash_is_refetched(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    data = os.urandom(3 * 1024 * 1024)
    bucket.put("r/shard.bin", data)
    dest = tmp_path / "r"
    dest.mkdir()
    etag = boto_client(bucket.port).head_object(Bucket=bucket.name, Key="r/shard.bin")["ETag"]
    # What a crash can leave: parts recorded as written whose bytes never reached the disk.
    (dest / "shard.bin.partial").write_bytes(b"\0" * len(data))
    header = {"etag": etag.strip('"'), "part_size": 1 << 20, "size": len(data)}
    (dest / "shard.bin.partial.parts").write_text(json.dumps(header, sort_keys=True) + "\n0\n")
    bucket.put("r/hgxserve-manifest.json", b"")  # placeholder, replaced below
    assert (
        hgx(aws_env, "manifest", f"s3://{bucket.name}/r/", *endpoint(bucket.port), "--publish").rc
        == 0
    )
    run = part_sync(aws_env, f"s3://{bucket.name}/r/", dest, bucket.port)
    assert run.rc == 0, run.text
    assert "fetching them afresh" in run.err
    assert (dest / "shard.bin").read_bytes() == data


def test_truncated_local_file_caught_by_check_marker_and_verify_then_repaired(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    files, src, dest = synced_model(bucket, aws_env, tmp_path, "t", 3)
    shard = dest / "model-00001-of-00002.safetensors"
    os.truncate(shard, 1000)
    check = hgx(aws_env, "check-marker", str(dest))
    assert check.rc == 1 and "model-00001-of-00002.safetensors" in check.err
    ver = hgx(aws_env, "verify", str(dest), "-q", *PARTIAL_TREE)
    assert ver.rc == 1
    assert "model-00001-of-00002.safetensors: truncated: 1000 bytes" in ver.err
    assert not (dest / ".hgxserve" / "verified").exists()
    repaired = part_sync(aws_env, src, dest, bucket.port, "--json")
    assert repaired.rc == 0 and json.loads(repaired.out)["fetched"] == 1
    assert tree(dest) == files
    assert hgx(aws_env, "check-marker", str(dest)).rc == 0


def test_flipped_byte_in_local_file_verify_full(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    _, _, dest = synced_model(bucket, aws_env, tmp_path, "f", 4)
    shard = dest / "model-00002-of-00002.safetensors"
    stat = shard.stat()
    with open(shard, "r+b") as fh:
        fh.seek(12345)
        byte = fh.read(1)
        fh.seek(12345)
        fh.write(bytes([byte[0] ^ 0x80]))
    # Hide the change from the stat check: only a full rehash can find it.
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # unchanged by stat: skipped
    assert hgx(aws_env, "verify", str(dest), "-q", *PARTIAL_TREE).rc == 0
    full = hgx(aws_env, "verify", str(dest), "--full", "-q", *PARTIAL_TREE)
    assert full.rc == 1 and "model-00002-of-00002.safetensors: sha256" in full.err
    assert hgx(aws_env, "check-marker", str(dest)).rc == 1


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(
            Fault("slowdown_gets", 6, "slowdowns_sent", ("SlowDown", "retry")), id="throttling"
        ),
        # Parts are written to the .partial slice by slice as they arrive; a body cut halfway
        # (with garbage in the half that arrived) must be fetched and written again from its start.
        pytest.param(Fault("cut_gets", 5, "cuts_sent", ("retry",)), id="connection-cut-mid-part"),
    ],
)
def test_faulty_store_is_retried_and_completes(
    bucket: Bucket,
    aws_env: dict[str, str],
    proxy: tuple[int, ProxyState],
    tmp_path: Path,
    fault: Fault,
) -> None:
    files, src, dest = uploaded_model(bucket, tmp_path, "f", 5)
    sync_through(fault, proxy, lambda port: part_sync(aws_env, src, dest, port))
    assert tree(dest) == files
    assert not list(dest.rglob("*.partial*"))  # a cut part is written again from its start


def test_dead_endpoint_clear_error_nothing_marked(aws_env: dict[str, str], tmp_path: Path) -> None:
    dead = free_port()
    dest = tmp_path / "d"
    run = hgx(
        aws_env,
        "sync",
        "s3://models/x/",
        str(dest),
        "--endpoint-url",
        f"http://127.0.0.1:{dead}",
        "--retries",
        "1",
        "-q",
    )
    assert run.rc == 3, run.text
    assert "refused" in run.err and "Traceback" not in run.text
    assert SECRET_KEY not in run.text
    assert not (dest / ".hgxserve" / "verified").exists()


def test_path_style_forbidden_gives_virtual_hint_and_virtual_works(
    bucket: Bucket, aws_env: dict[str, str], proxy: tuple[int, ProxyState], tmp_path: Path
) -> None:
    files, src, _ = uploaded_model(bucket, tmp_path, "v", 6)
    port, seen = proxy
    seen.faults.forbid_path_style_bucket = bucket.name
    path_style = part_sync(aws_env, src, tmp_path / "p", port)
    assert path_style.rc == 3, path_style.text
    assert "PathStyleDomainForbidden" in path_style.err
    assert "--addressing virtual" in path_style.err
    # Virtual-hosted names (no resolver knows s3.test) reach the server through HTTP_PROXY.
    env = dict(aws_env, HTTP_PROXY=f"http://127.0.0.1:{port}", NO_PROXY="")
    virtual = hgx(
        env,
        "sync",
        src,
        str(tmp_path / "v"),
        "--endpoint-url",
        f"http://s3.test:{free_port()}",
        "--addressing",
        "virtual",
        *PART,
    )
    assert virtual.rc == 0, virtual.text
    assert tree(tmp_path / "v") == files
    hosts = {s.host.split(":")[0] for s in seen.seen if s.range}
    assert hosts == {f"{bucket.name}.s3.test"}
    # Seed 003's form: the endpoint already names the bucket.
    seeded = hgx(
        env,
        "sync",
        src,
        str(tmp_path / "e"),
        "--endpoint-url",
        f"http://{bucket.name}.s3.test:{free_port()}",
        "--addressing",
        "virtual",
        *PART,
    )
    assert seeded.rc == 0, seeded.text


def test_disk_full_is_a_clear_error(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path) as mnt:
        bucket.put("full/a.bin", os.urandom(2 * 1024 * 1024))
        bucket.put("full/b.bin", os.urandom(3 * 1024 * 1024))
        run = part_sync(aws_env, f"s3://{bucket.name}/full/", mnt / "m", bucket.port)
        assert run.rc == 5, run.text
        assert "disk full" in run.err and "Traceback" not in run.text
        assert not (mnt / "m" / ".hgxserve" / "verified").exists()
        complete = [n for n in ("a.bin", "b.bin") if (mnt / "m" / n).exists()]
        assert len(complete) < 2  # the file that did not fit never appears under its name


def test_marker_check_digest_mismatch(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    upload(bucket, "k/", {"a.bin": b"a" * 1000})
    dest = tmp_path / "k"
    assert part_sync(aws_env, f"s3://{bucket.name}/k/", dest, bucket.port).rc == 0
    other = "sha256:" + "0" * 64
    run = hgx(aws_env, "check-marker", str(dest), "--digest", other)
    assert run.rc == 1 and "is required" in run.err
    assert hgx(aws_env, "check-marker", str(tmp_path / "nothing")).rc == 1


def test_sha256_required_by_default(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """Without a manifest or an S3 checksum nothing is downloaded unless the user opts out."""
    bucket.put("u/with.bin", os.urandom(50_000), ChecksumAlgorithm="SHA256")
    bucket.put("u/without.bin", os.urandom(50_000))
    src, dest = f"s3://{bucket.name}/u/", tmp_path / "u"
    base = [*endpoint(bucket.port), "--part-size", "1MiB", *PARTIAL_TREE]
    refused = hgx(aws_env, "sync", src, str(dest), *base)
    assert refused.rc == 1, refused.text
    assert "without.bin" in refused.err and "nothing was downloaded" in refused.err
    assert "--allow-size-etag" in refused.err and "Traceback" not in refused.text
    assert not (dest / "with.bin").exists() and not (dest / "without.bin").exists()
    assert not (dest / ".hgxserve" / "verified").exists()
    opted = hgx(aws_env, "sync", src, str(dest), *base, "--allow-size-etag")
    assert opted.rc == 0, opted.text
    assert "integrity opt-out: 1 file(s)" in opted.err
    assert "1 by size + ETag only" in opted.err


def test_incomplete_model_is_not_marked(
    bucket: Bucket, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """Every file matches its sha256, but the index names a shard the tree lacks: no marker."""
    files = model_files()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-03.safetensors"}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    upload(bucket, "inc/", files)
    src, dest = f"s3://{bucket.name}/inc/", tmp_path / "inc"
    assert hgx(aws_env, "manifest", src, *endpoint(bucket.port), "--publish").rc == 0
    run = hgx(aws_env, "sync", src, str(dest), *endpoint(bucket.port), "-q")
    assert run.rc == 1, run.text
    assert "incomplete" in run.err and "model-03.safetensors" in run.err
    assert not (dest / ".hgxserve" / "verified").exists()
    ver = hgx(aws_env, "verify", str(dest), "-q")
    assert ver.rc == 1 and "incomplete" in ver.err
    check = hgx(aws_env, "check-marker", str(dest))
    assert check.rc != 0
