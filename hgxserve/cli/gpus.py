"""`hgxserve gpus`: the GPU checks engine units run around the engine.

- `check-free --gpus 0,1` (ExecStartPre): exit 1, listing pid and MiB per busy GPU, when any of
  those GPUs runs a compute process — a second engine on busy GPUs fails after minutes of loading.
- `wait-free --gpus 0,1 --timeout 120` (ExecStopPost): wait, bounded, until they run none, so the
  next start (or a rollback) does not race the old engine's memory release (seed 003 §9.2).
- `exec-with-credentials VAR=name ... -- argv`: export each VAR from the systemd credential
  `name` ($CREDENTIALS_DIRECTORY/name) and exec argv, so secrets stay off command lines and out
  of unit files.

The checks themselves are `hgxserve.gpus.checks`.

    $ hgxserve gpus check-free --gpus 4,5,6,7
    GPU 5 (GPU-...0006) is busy: pid 4242 uses 130215 MiB
"""

from __future__ import annotations

import os

import click

from hgxserve.base.errors import ExitCode, Found, cli_errors, fail
from hgxserve.gpus import checks


def parse_gpu_list(text: str) -> list[int]:
    """`0,1, 3` -> [0, 1, 3]."""
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"not a list of GPU indices: {text!r} (e.g. 0,1,2,3)") from exc
    if not gpus or any(g < 0 for g in gpus):
        raise click.BadParameter(f"not a list of GPU indices: {text!r} (e.g. 0,1,2,3)")
    return gpus


@click.group()
def gpus() -> None:
    """Check or wait until GPUs hold no compute processes (used by engine units).

    \b
    hgxserve gpus check-free --gpus 0,1,2,3
    hgxserve gpus wait-free --gpus 0,1,2,3 --timeout 120
    """


@gpus.command("check-free")
@click.option("--gpus", "gpu_list", required=True, help="GPU indices, e.g. 0,1,2,3.")
@cli_errors
def check_free(gpu_list: str) -> None:
    """Exit 0 when no compute process runs on these GPUs, else 1 with pid/MiB per GPU.

    \b
    hgxserve gpus check-free --gpus 4,5,6,7
    """
    wanted = parse_gpu_list(gpu_list)
    busy = checks.busy_processes(wanted)
    if busy:
        for line in checks.describe(busy):
            click.echo(line, err=True)
        raise Found(f"GPUs {gpu_list} are not free: stop what runs there first")
    click.echo(f"GPUs {gpu_list} are free")


@gpus.command("wait-free")
@click.option("--gpus", "gpu_list", required=True, help="GPU indices, e.g. 0,1,2,3.")
@click.option("--timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Seconds to wait at most.")  # fmt: skip
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between checks.")  # fmt: skip
@cli_errors
def wait_free(gpu_list: str, timeout: float, interval: float) -> None:
    """Wait until no compute process runs on these GPUs; exit 1 after --timeout seconds.

    \b
    hgxserve gpus wait-free --gpus 0,1,2,3 --timeout 120
    """
    busy = checks.wait_free(parse_gpu_list(gpu_list), timeout, interval)
    if busy:
        for line in checks.describe(busy):
            click.echo(line, err=True)
        raise Found(f"GPUs {gpu_list} still hold processes after {timeout:g} s")
    click.echo(f"GPUs {gpu_list} are free")


@gpus.command("exec-with-credentials", context_settings={"ignore_unknown_options": True})
@click.argument("assignments", nargs=-1, required=True, type=click.UNPROCESSED)
@cli_errors
def exec_with_credentials(assignments: tuple[str, ...]) -> None:
    """Export VAR from the systemd credential NAME for each VAR=NAME, then exec the command.

    \b
    hgxserve gpus exec-with-credentials HF_TOKEN=hf-token -- /opt/vllm/bin/vllm serve ...
    """
    pairs, argv = checks.split_assignments(list(assignments))
    if not pairs or not argv:
        fail("usage: exec-with-credentials VAR=NAME ... -- COMMAND [ARG...]", ExitCode.USAGE)
    try:
        env = checks.credentials_env(pairs, os.environ.get("CREDENTIALS_DIRECTORY"), os.environ)
    except checks.CredentialError as exc:
        fail(str(exc), ExitCode.USAGE)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc.strerror}", 127)
