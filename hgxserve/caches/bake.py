"""Bake a JIT/compile cache: start the engine as its unit would, warm every shape, until quiet.

The engine runs as a local child process with exactly the unit's argv and environment (plus the
PATH and locale systemd gives every unit, and its secret variables read from the credentials
its LoadCredential= lines name, as `exec-with-credentials` gives them in the unit), its output
in a log file; a keyed engine (VLLM_API_KEY) gets its key with every warm-up request. After
`/health` answers 200 the bake sends every warm-up shape, scans what the engine logged meanwhile
for JIT/compile lines, and warms again until a round logs none (bounded). Then it stops the
engine like systemd would (SIGTERM to its process group, wait, SIGKILL after a timeout) and
writes a bake record into the cache directory. For SGLang it first runs
`python -m sglang.compile_deep_gemm` with the server's own arguments, which compiles DeepGEMM
kernels for every M ahead of time.

    >>> record = bake(BakeSpec(argv=unit.argv, env=unit.env, cache_dir=d,  # doctest: +SKIP
    ...                        base_url="http://127.0.0.1:8100", shapes=plan))
    >>> record["settled"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.cachelayout import BAKE_RECORD, ENV_SUBDIRS
from hgxserve.base.credstore import read_credential
from hgxserve.base.defaults import ENGINE
from hgxserve.base.enginekey import strip_key_launcher
from hgxserve.base.errors import HgxserveError
from hgxserve.caches.logscan import JitHit, read_from, scan
from hgxserve.caches.warmup import Engine, Shape, run_shape, served_model

# What systemd puts in every unit's environment before Environment= lines.
SYSTEMD_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


class BakeError(HgxserveError):
    """The bake could not finish; the message says why and where the engine log is."""


@dataclass
class BakeSpec:
    argv: list[str]
    env: dict[str, str]
    cache_dir: str
    base_url: str
    shapes: list[Shape]
    engine: str = ENGINE
    key: str | None = None
    unit: str | None = None
    log_path: str | None = None
    ready_timeout: float = 3600.0
    request_timeout: float = 900.0
    stop_timeout: float = 120.0
    max_rounds: int = 4
    settle_seconds: float = 1.0
    deep_gemm_timeout: float = 7200.0
    compile_deep_gemm: bool = True
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # secret variables -> LoadCredential= source (NAME or NAME:PATH); values read at bake time
    secret_env: dict[str, str] = field(default_factory=dict)
    api_key_var: str | None = None  # the secret variable the engine takes its API key from
    # the user the engine runs as, as its unit's User= (None: as the caller); the bake hands
    # it the cache and run directories first, so the unit can write what the bake left
    user: str | None = None


@dataclass(frozen=True)
class RunAs:
    """A user to start the engine as: what systemd's User= gives a unit (its uid, primary
    group, supplementary groups from the group file, and HOME/USER/LOGNAME/SHELL)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    env: dict[str, str]

    @classmethod
    def named(cls, name: str) -> RunAs:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise BakeError(
                f"no user {name} on this host: the engine user is created by the caches and "
                "engines stages (roles/engine_user.py)"
            ) from None
        groups = tuple(os.getgrouplist(name, entry.pw_gid))
        env = {"HOME": entry.pw_dir, "USER": name, "LOGNAME": name, "SHELL": entry.pw_shell}
        return cls(entry.pw_uid, entry.pw_gid, groups, env)

    def popen_args(self) -> dict[str, Any]:
        """subprocess keywords that start a child as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def hand_over(self, paths: list[str]) -> None:
        """Make each path and everything under it this user's, as the caches stage does
        (hgxserve.operations.caches.hand_over): depth first, each directory after what is in
        it; links themselves, never what they point at; no file with other hard links."""
        for top in paths:
            for folder, dirs, files in os.walk(top, topdown=False):
                for name in [*files, *dirs]:
                    self._own(os.path.join(folder, name))
            self._own(top)

    def _own(self, path: str) -> None:
        st = os.lstat(path)
        if st.st_uid != self.uid and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


def unit_environment(env: dict[str, str]) -> dict[str, str]:
    """The environment a systemd unit with these Environment= entries would start with."""
    return {**SYSTEMD_BASE_ENV, **env}


def deep_gemm_argv(argv: list[str]) -> list[str]:
    """`python -m sglang.compile_deep_gemm <server args>` from an `sglang serve` argv.

    >>> deep_gemm_argv(["/opt/sg/bin/sglang", "serve", "--model-path", "/m", "--tp", "8"])
    ['/opt/sg/bin/python', '-m', 'sglang.compile_deep_gemm', '--model-path', '/m', '--tp', '8']
    """
    argv = strip_key_launcher(argv)  # a keyed SGLang engine's launcher: the key is not needed
    program = os.path.basename(argv[0])
    if program == "sglang" and len(argv) > 1 and argv[1] == "serve":
        flags = argv[2:]
    elif "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == [
        "sglang.launch_server"
    ]:
        flags = argv[argv.index("-m") + 2 :]
    else:
        raise BakeError(
            f"cannot derive compile_deep_gemm from {argv[:3]}: expected `sglang serve ...` or "
            "`python -m sglang.launch_server ...`; use --no-deep-gemm to skip it"
        )
    folder = os.path.dirname(argv[0])
    python = os.path.join(folder, "python") if folder else "python3"
    return [python, "-m", "sglang.compile_deep_gemm", *flags]


# Scratch directories a unit's ExecStartPre creates besides the cache dirs.
RUN_DIR_VARS = ("TMPDIR", "VLLM_RPC_BASE_PATH", "XDG_CACHE_HOME", "HF_HOME")


def ensure_cache_dirs(env: dict[str, str], run_as: RunAs | None = None) -> list[str]:
    """Create the directories the unit's cache (and scratch) variables point at, as the unit
    does for `run_as` when given: root makes only their tops (the key and run directories,
    whose parents are root's), refuses a top that is a link and hands each to the user (links
    inside as links, never what they point at); the directories inside are made by the user,
    so a link the user planted there leads nowhere the user could not already write.

    Returns the cache directories.
    """
    scratch = [env[var] for var in RUN_DIR_VARS if env.get(var, "").startswith("/")]
    made = sorted({env[var] for var in ENV_SUBDIRS if os.path.isabs(env.get(var) or "")})
    if run_as is None:
        for path in [*scratch, *made]:
            os.makedirs(path, exist_ok=True)
        return made
    for top in sorted({os.path.dirname(p) for p in [*scratch, *made]}):
        os.makedirs(top, exist_ok=True)
        if os.path.islink(top):
            raise BakeError(f"{top} is a link: refusing to hand it to the engine user")
        run_as.hand_over([top])
    proc = subprocess.run(
        ["mkdir", "-p", "--", *scratch, *made],
        capture_output=True,
        text=True,
        check=False,
        **run_as.popen_args(),
    )
    if proc.returncode != 0:
        raise BakeError(f"making the cache directories as the engine user: {proc.stderr.strip()}")
    return made


def read_secrets(secret_env: dict[str, str]) -> dict[str, str]:
    """Each secret variable's value from its credential (as `hgxserve release wait-ready
    --api-key-credential` reads the engine key); the error names the credential, not a value."""
    values = {}
    for var, source in sorted(secret_env.items()):
        try:
            values[var] = read_credential(source)
        except HgxserveError as exc:
            raise BakeError(f"{var} for the engine: {exc}") from None
    return values


def _health(base_url: str) -> int | None:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 8192))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


def stop_engine(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """SIGTERM the engine's process group (KillMode=control-group), wait, SIGKILL if needed."""
    started = time.monotonic()
    killed = False
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    # Workers left in the group after the leader exited get the same end.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return {
        "pid": proc.pid,
        "returncode": proc.returncode,
        "sigkill": killed,
        "seconds": round(time.monotonic() - started, 3),
    }


def _run_deep_gemm(
    spec: BakeSpec, env: dict[str, str], log: Any, run_as: RunAs | None
) -> dict[str, Any]:
    argv = deep_gemm_argv(spec.argv)
    log.write(f"### hgxserve cache bake: {' '.join(argv)}\n".encode())
    log.flush()
    started = time.monotonic()
    try:
        proc = subprocess.run(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=spec.deep_gemm_timeout,
            **(run_as.popen_args() if run_as else {}),
        )
    except FileNotFoundError as exc:
        raise BakeError(f"compile_deep_gemm: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BakeError(f"compile_deep_gemm ran past {spec.deep_gemm_timeout:g}s") from exc
    if proc.returncode != 0:
        raise BakeError(
            f"compile_deep_gemm exited {proc.returncode}; log: {spec.log_path}\n"
            + _tail(spec.log_path or "")
        )
    return {"argv": argv, "seconds": round(time.monotonic() - started, 3)}


def bake(spec: BakeSpec) -> dict[str, Any]:
    """Run one bake and return (and write) its record.

    >>> bake(spec)["rounds"][-1]["jit_lines"]  # doctest: +SKIP
    0
    """
    os.makedirs(spec.cache_dir, exist_ok=True)
    secrets = read_secrets(spec.secret_env)
    run_as = RunAs.named(spec.user) if spec.user else None
    env = unit_environment(spec.env)
    if run_as is not None:
        env.update(run_as.env)
    dirs = ensure_cache_dirs(env, run_as)
    if run_as is not None:
        run_as.hand_over([spec.cache_dir])
    env.update(secrets)  # in the engine's environment only: not in the record, log or argv
    api_key = secrets.get(spec.api_key_var) if spec.api_key_var else None
    log_path = spec.log_path or os.path.join(
        spec.cache_dir, "..", f".bake-{spec.key or 'engine'}.log"
    )
    log_path = os.path.abspath(log_path)
    spec.log_path = log_path
    record: dict[str, Any] = {
        "format": "hgxserve-bake/1",
        "key": spec.key,
        "unit": spec.unit,
        "engine": spec.engine,
        "argv": spec.argv,
        "env": dict(sorted(spec.env.items())),
        "secret_env": dict(sorted(spec.secret_env.items())),  # credential names, no values
        "cache_dirs": dirs,
        "user": spec.user,  # who the engine ran as (None: the caller)
        "shapes": [s.as_dict() for s in spec.shapes],
        **spec.extra,
    }
    # An engine already on the port (the unit itself, or a stray bake) would answer /health and
    # take the warm-up while ours fails to bind: the bake would record someone else's run.
    if _health(spec.base_url) is not None:
        raise BakeError(
            f"something already answers at {spec.base_url}: stop it first "
            f"(systemctl stop {spec.unit or 'the engine unit'}); the bake starts its own engine"
        )
    started = time.monotonic()
    with open(log_path, "ab") as log:
        if spec.engine == "sglang" and spec.compile_deep_gemm:
            record["compile_deep_gemm"] = _run_deep_gemm(spec, env, log, run_as)
        log.write(f"### hgxserve cache bake: {' '.join(spec.argv)}\n".encode())
        log.flush()
        start_offset = log.tell()
        try:
            proc = subprocess.Popen(
                spec.argv,
                env=env,
                **(run_as.popen_args() if run_as else {}),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, stopped as one like a unit
            )
        except OSError as exc:
            raise BakeError(f"cannot start {spec.argv[0]}: {exc.strerror}") from exc
    try:
        baking = _Baking(spec, proc, log_path, api_key)
        record.update(_bake_running(baking, start_offset, started))
    finally:
        record["stop"] = stop_engine(proc, spec.stop_timeout)
    record["seconds"] = round(time.monotonic() - started, 3)
    path = os.path.join(spec.cache_dir, BAKE_RECORD)
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(path + ".tmp", path)
    if run_as is not None:
        run_as.hand_over([path])
    return record


@dataclass
class _Baking:
    """The engine a bake started: what it was started from, its process, log and API key."""

    spec: BakeSpec
    proc: subprocess.Popen[bytes]
    log_path: str
    api_key: str | None = None

    def check_alive(self, when: str) -> None:
        if self.proc.poll() is not None:
            raise BakeError(
                f"engine exited with {self.proc.returncode} {when}; log: {self.log_path}\n"
                + _tail(self.log_path)
            )


def _bake_running(baking: _Baking, offset: int, started: float) -> dict[str, Any]:
    spec, log_path = baking.spec, baking.log_path
    _wait_ready(baking)
    ready_seconds = time.monotonic() - started
    startup_text, offset = read_from(log_path, offset)
    startup_hits = scan(startup_text)
    model = spec.model or served_model(spec.base_url, api_key=baking.api_key)
    if not model:
        raise BakeError(f"{spec.base_url}/v1/models lists no model; log: {log_path}")
    engine = Engine(spec.base_url, model, baking.api_key, spec.request_timeout)
    rounds: list[dict[str, Any]] = []
    settled = False
    for round_no in range(1, spec.max_rounds + 1):
        round_record, offset = _warm_round(baking, engine, round_no, offset)
        rounds.append(round_record)
        if not round_record["jit_lines"]:
            settled = True
            break
    return {
        "model": model,
        "ready_seconds": round(ready_seconds, 3),
        "startup_jit_lines": len(startup_hits),
        "startup_jit": [h.as_dict() for h in startup_hits[:50]],
        "rounds": rounds,
        "settled": settled,
        "log": log_path,
    }


def _wait_ready(baking: _Baking) -> None:
    """Wait for the engine's /health to answer 200, up to the spec's ready timeout."""
    spec = baking.spec
    deadline = time.monotonic() + spec.ready_timeout
    while True:
        baking.check_alive("before ready")
        if _health(spec.base_url) == 200:
            return
        if time.monotonic() > deadline:
            raise BakeError(
                f"engine not ready after {spec.ready_timeout:g}s at {spec.base_url}/health; "
                f"log: {baking.log_path}\n" + _tail(baking.log_path)
            )
        time.sleep(0.5)


def _warm_round(
    baking: _Baking, engine: Engine, round_no: int, offset: int
) -> tuple[dict[str, Any], int]:
    """Send every shape once; the round's record and the log offset after it."""
    spec = baking.spec
    round_started = time.monotonic()
    results = []
    for shape in spec.shapes:
        baking.check_alive("during warm-up")
        results.append(run_shape(engine, shape, round_no))
    # Lines about a request can trail its response a little.
    time.sleep(spec.settle_seconds)
    text, offset = read_from(baking.log_path, offset)
    hits: list[JitHit] = scan(text)
    failed = sum(len(r.errors) for r in results)
    if failed:
        first = next(e for r in results for e in r.errors)
        raise BakeError(
            f"round {round_no}: {failed} warm-up request(s) failed, first: {first}; "
            f"log: {baking.log_path}"
        )
    record = {
        "round": round_no,
        "requests": sum(r.ok for r in results) + failed,
        "failed": failed,
        "jit_lines": len(hits),
        "jit": [h.as_dict() for h in hits[:50]],
        "shapes": [r.as_dict() for r in results],
        "seconds": round(time.monotonic() - round_started, 3),
    }
    return record, offset
