"""The GPU checks engine units run around the engine: which compute processes hold given GPUs
(nvidia-smi's `--query-gpu=index,uuid` and `--query-compute-apps=gpu_uuid,pid,used_memory`, both
`--format=csv,noheader,nounits`, through the parsers in `hgxserve.parsers.outputs`), a bounded
wait until they hold none, and the environment a command gets from systemd credentials.

    busy_processes([4, 5])  # [{"index": 5, "uuid": "GPU-...", "pid": 4242, "used_memory_mib": ...}]
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hgxserve.base.errors import UsageError
from hgxserve.parsers.outputs import parse_compute_apps, parse_smi_csv

QUERY_GPUS = ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader,nounits"]
QUERY_APPS = [
    "nvidia-smi",
    "--query-compute-apps=gpu_uuid,pid,used_memory",
    "--format=csv,noheader,nounits",
]
NVIDIA_SMI_TIMEOUT_S = 30
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.-]+$")


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


def wait_free(
    gpus: list[int], timeout: float, interval: float, sleep: Callable[[float], None] = time.sleep
) -> list[dict[str, object]]:
    """Poll until no compute process runs on `gpus` or `timeout` seconds pass; what still runs
    there (empty: they are free)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = busy_processes(gpus)
        if not busy or time.monotonic() >= deadline:
            return busy
        sleep(min(interval, max(deadline - time.monotonic(), 0.0)))


class CredentialError(UsageError):
    """A credential named on `exec-with-credentials` cannot be read, or there is none to read."""


def split_assignments(args: list[str]) -> tuple[list[str], list[str]]:
    """`VAR=NAME ... [--] COMMAND ARG...` -> (the VAR=NAME pairs, the command): the command
    starts at the first word that is not VAR=NAME (click drops the first "--")."""
    args = list(args)
    if args and args[0] == "--":
        args.pop(0)
    split = next((i for i, a in enumerate(args) if not ASSIGNMENT.match(a)), len(args))
    pairs, argv = args[:split], args[split:]
    if argv and argv[0] == "--":
        argv.pop(0)
    return pairs, argv


def credentials_env(
    pairs: list[str], directory: str | None, environ: Mapping[str, str]
) -> dict[str, str]:
    """`environ` with each VAR of VAR=NAME set from the systemd credential NAME in `directory`
    ($CREDENTIALS_DIRECTORY), its trailing newlines dropped."""
    if not directory:
        raise CredentialError(
            "CREDENTIALS_DIRECTORY is not set: run this from a unit with LoadCredential="
        )
    env = dict(environ)
    for pair in pairs:
        var, _, name = pair.partition("=")
        try:
            value = (Path(directory) / name).read_text()
        except OSError as exc:
            raise CredentialError(
                f"cannot read credential {name!r} for {var}: {exc.strerror}"
            ) from None
        env[var] = value.rstrip("\n")
    return env
