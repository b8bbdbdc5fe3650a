"""`hgxserve runtime ...`: host-side checks of what the runtime stage installed.

hgxserve runtime check-files /etc/hgxserve/files/t.jinja=<sha256>   # ExecStartPre of units
"""

from __future__ import annotations

import hashlib

import click


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
                got = hashlib.file_digest(fh, "sha256").hexdigest()
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
