"""`hgxserve gpus`: the GPU checks engine units run around the engine.

- `check-free --gpus 0,1` (ExecStartPre): exit 1, listing pid and MiB per busy GPU, when any of
  those GPUs runs a compute process — a second engine on busy GPUs fails after minutes of loading.
- `wait-free --gpus 0,1 --timeout 120` (ExecStopPost): wait, bounded, until they run none, so the
  next start (or a rollback) does not race the old engine's memory release (seed 003 §9.2).
- `exec-with-credentials VAR=name ... -- argv`: export each VAR from the systemd credential
  `name` ($CREDENTIALS_DIRECTORY/name) and exec argv, so secrets stay off command lines and out
  of unit files.

Reads `nvidia-smi --query-gpu=index,uuid` and `--query-compute-apps=gpu_uuid,pid,used_memory`
(both `--format=csv,noheader,nounits`) through the parsers in `hgxserve.parsers.outputs`.

    $ hgxserve gpus check-free --gpus 4,5,6,7
    GPU 5 (GPU-...0006) is busy: pid 4242 uses 130215 MiB
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import click

from hgxserve.base.errors import ExitCode, Found, UsageError, cli_errors, fail
from hgxserve.parsers.outputs import parse_compute_apps, parse_smi_csv

QUERY_GPUS = ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader,nounits"]
QUERY_APPS = [
    "nvidia-smi",
    "--query-compute-apps=gpu_uuid,pid,used_memory",
    "--format=csv,noheader,nounits",
]
NVIDIA_SMI_TIMEOUT_S = 30
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.-]+$")


class GpuQueryError(UsageError):
    """nvidia-smi is missing, failed, or printed something unexpected."""


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise GpuQueryError(
            "nvidia-smi not found on PATH: is the NVIDIA driver installed?"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise GpuQueryError(f"{argv[1]} did not answer within {NVIDIA_SMI_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        detail = (done.stdout + done.stderr).strip().splitlines()
        raise GpuQueryError(
            f"nvidia-smi {argv[1]} failed (exit {done.returncode}): "
            + (detail[0] if detail else "no output")
        )
    return done.stdout


def parse_gpu_list(text: str) -> list[int]:
    """`0,1, 3` -> [0, 1, 3]."""
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"not a list of GPU indices: {text!r} (e.g. 0,1,2,3)") from exc
    if not gpus or any(g < 0 for g in gpus):
        raise click.BadParameter(f"not a list of GPU indices: {text!r} (e.g. 0,1,2,3)")
    return gpus


def busy_processes(gpus: list[int]) -> list[dict[str, object]]:
    """Compute processes on the given GPU indices: [{index, uuid, pid, used_memory_mib}]."""
    try:
        rows = parse_smi_csv(_run(QUERY_GPUS), ("index", "uuid"))
        apps = parse_compute_apps(_run(QUERY_APPS))
    except ValueError as exc:
        raise GpuQueryError(f"unexpected nvidia-smi output: {exc}") from exc
    uuid_of = {int(r["index"]): str(r["uuid"]) for r in rows}
    missing = [g for g in gpus if g not in uuid_of]
    if missing:
        present = ",".join(str(i) for i in sorted(uuid_of)) or "none"
        raise GpuQueryError(
            f"GPU {','.join(map(str, missing))} not present on this host (present: {present})"
        )
    index_of = {uuid_of[g]: g for g in gpus}
    busy = [
        {"index": index_of[a["gpu_uuid"]], "uuid": a["gpu_uuid"], **a}
        for a in apps
        if a["gpu_uuid"] in index_of
    ]
    return sorted(busy, key=lambda b: (b["index"], b["pid"]))


def describe(busy: list[dict[str, object]]) -> list[str]:
    return [
        f"GPU {b['index']} ({b['uuid']}) is busy: pid {b['pid']} uses "
        f"{b['used_memory_mib'] if b['used_memory_mib'] is not None else '?'} MiB"
        for b in busy
    ]


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
    busy = busy_processes(wanted)
    if busy:
        for line in describe(busy):
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
    wanted = parse_gpu_list(gpu_list)
    deadline = time.monotonic() + timeout
    while True:
        busy = busy_processes(wanted)
        if not busy:
            click.echo(f"GPUs {gpu_list} are free")
            return
        if time.monotonic() >= deadline:
            for line in describe(busy):
                click.echo(line, err=True)
            raise Found(f"GPUs {gpu_list} still hold processes after {timeout:g} s")
        time.sleep(min(interval, max(deadline - time.monotonic(), 0.0)))


@gpus.command("exec-with-credentials", context_settings={"ignore_unknown_options": True})
@click.argument("assignments", nargs=-1, required=True, type=click.UNPROCESSED)
@cli_errors
def exec_with_credentials(assignments: tuple[str, ...]) -> None:
    """Export VAR from the systemd credential NAME for each VAR=NAME, then exec the command.

    \b
    hgxserve gpus exec-with-credentials HF_TOKEN=hf-token -- /opt/vllm/bin/vllm serve ...
    """
    # click drops the first "--"; the command starts at the first word that is not VAR=NAME
    args = list(assignments)
    if args and args[0] == "--":
        args.pop(0)
    split = next((i for i, a in enumerate(args) if not _ASSIGNMENT.match(a)), len(args))
    pairs, argv = args[:split], args[split:]
    if argv and argv[0] == "--":
        argv.pop(0)
    if not pairs or not argv:
        fail("usage: exec-with-credentials VAR=NAME ... -- COMMAND [ARG...]", ExitCode.USAGE)
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        fail(
            "CREDENTIALS_DIRECTORY is not set: run this from a unit with LoadCredential=",
            ExitCode.USAGE,
        )
    env = dict(os.environ)
    for pair in pairs:
        var, _, name = pair.partition("=")
        try:
            value = (Path(directory) / name).read_text()
        except OSError as exc:
            fail(f"cannot read credential {name!r} for {var}: {exc.strerror}", ExitCode.USAGE)
        env[var] = value.rstrip("\n")
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc.strerror}", 127)
