"""`hgxserve runtime ...`: host-side checks of what the runtime stage installed.

hgxserve runtime check-files /etc/hgxserve/files/t.jinja=<sha256>   # ExecStartPre of units
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hgxserve.base.compat import file_sha256
from hgxserve.base.errors import cli_errors


@click.group()
def runtime() -> None:
    """Check engine runtimes and the files a topology ships (host side)."""


@runtime.command("check-files")
@click.argument("pairs", nargs=-1, required=True, metavar="PATH=SHA256...")
def check_files(pairs: tuple[str, ...]) -> None:
    """Exit 1 unless every PATH exists with content SHA256 (what engine units run first).

    \b
    hgxserve runtime check-files /etc/hgxserve/files/tool_chat_template.jinja=4ba2ab3d...
    """
    problems = []
    for pair in pairs:
        path, sep, want = pair.rpartition("=")
        if not sep or len(want) != 64:
            raise click.UsageError(f"{pair!r}: expected PATH=SHA256 (64 hex digits)")
        try:
            with open(path, "rb") as fh:
                got = file_sha256(fh)
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc} (the runtime stage ships it)")
            continue
        if got != want:
            problems.append(f"{path}: sha256 {got}, expected {want} (run the runtime stage)")
    for line in problems:
        click.echo(line, err=True)
    if problems:
        raise SystemExit(1)
    click.echo(f"{len(pairs)} file(s) as the topology pins them")


def _s3_fetch_options(what: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The options of a command that fetches one object from the weights' S3 to --out."""

    def apply(func: Callable[..., None]) -> Callable[..., None]:
        for option in reversed(
            (
                click.option(
                    "--out", "out", required=True, type=click.Path(dir_okay=False), help=what
                ),
                click.option("--env-file", help="KEY=VALUE file with the S3 credentials (0600)."),
                click.option("--endpoint-url", help="S3 endpoint (default: the AWS settings)."),
                click.option("--region", help="S3 region (default: the AWS settings)."),
                click.option(
                    "--addressing", default="auto", type=click.Choice(["auto", "path", "virtual"])
                ),
            )
        ):
            func = option(func)
        return func

    return apply


@runtime.command("fetch-image")
@click.argument("url")
@click.argument("digest")
@_s3_fetch_options("Archive path.")
@cli_errors
def fetch_image(url: str, digest: str, out: str, **s3: Any) -> None:
    """Download an OCI image archive from S3 and verify it holds manifest DIGEST.

    Nothing is left at --out unless the archive is the pinned image; an archive already there
    and verified is not downloaded again.

    \b
    hgxserve runtime fetch-image s3://models/images/sha256-ab12....oci.tar sha256:ab12... \\
        --out /var/lib/hgxserve/images/sha256-ab12....oci.tar --env-file /etc/hgxserve/s3.env
    """
    from hgxserve.runtime.images import S3Fetch
    from hgxserve.runtime.images import fetch_image as fetch

    dest = Path(out)
    size = fetch(url, digest, dest, S3Fetch(**s3))
    if size is None:
        click.echo(f"{dest}: already holds {digest}")
        return
    click.echo(f"{dest}: {size} bytes from {url}, holds {digest}")


@runtime.command("fetch-wheel")
@click.argument("url")
@click.argument("sha256")
@_s3_fetch_options("Wheel path.")
@cli_errors
def fetch_wheel(url: str, sha256: str, out: str, **s3: Any) -> None:
    """Download a wheel (`runtime.wheels[].url`) from S3 and check its SHA256.

    Nothing is left at --out unless the file has the pinned sha256; one already there with it
    is not downloaded again.

    \b
    hgxserve runtime fetch-wheel s3://wheels/deep_ep-1.2.1-cp312-cp312-linux_x86_64.whl \\
        <sha256> --out /var/tmp/hgxserve-runtime/wheels/deep_ep-1.2.1-....whl
    """
    from hgxserve.runtime.images import S3Fetch, fetch_file

    dest = Path(out)
    got = fetch_file(url, sha256, dest, S3Fetch(**s3))
    if got is None:
        click.echo(f"{dest}: already holds sha256 {sha256}")
        return
    if got != sha256:
        click.echo(f"{url}: sha256 {got}, the topology pins {sha256}", err=True)
        raise SystemExit(1)
    click.echo(f"{dest}: from {url}, sha256 {sha256}")


@runtime.command("verify-image")
@click.argument("archive", type=click.Path(exists=True, dir_okay=False))
@click.argument("digest")
@cli_errors
def verify_image(archive: str, digest: str) -> None:
    """Exit 1 unless the OCI archive holds image manifest DIGEST with every blob intact."""
    from hgxserve.runtime.images import verify_archive

    verify_archive(archive, digest)
    click.echo(f"{archive}: holds {digest}")
