"""The command-line error contract: one base error with an exit code, one decorator that turns
it into one line on stderr, and the exit codes every `hgxserve` command uses (README "Exit
codes" lists them).

    @cli_errors
    def command() -> None:
        raise UsageError("engine 'nope' is not in t.yml (engines: decode-0)")   # exit 2

Every message passes through `scrub()`, which hides each secret registered with
`register_secret()` (credentials loaded from env files, the environment or botocore).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NoReturn, TypeVar


class ExitCode(IntEnum):
    OK = 0
    FOUND = 1  # the check ran and says no: topology errors, content mismatch, JIT found, GPUs busy
    USAGE = 2  # bad arguments, unknown names, an input file that cannot be read or parsed
    SOURCE = 3  # a source or service is unreachable or failing (S3, source directory, nvidia-smi)
    CREDENTIALS = 4  # credentials missing or rejected, access denied
    LOCAL_IO = 5  # local filesystem: disk full, permission, read-only
    FAILED = 6  # the operation failed: release switch, render, bake, pack/restore, listen
    INTERRUPTED = 130  # Ctrl-C / SIGINT


class HgxserveError(Exception):
    """Base of every error a command reports as one line and an exit code."""

    exit_code: int = ExitCode.FAILED

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(HgxserveError):
    """Arguments or input that cannot work: a wrong name, an unreadable or unparseable file."""

    exit_code = ExitCode.USAGE


class Found(HgxserveError):
    """The check ran and found what it looks for (mismatch, JIT compiles, busy GPUs)."""

    exit_code = ExitCode.FOUND


# Values that must never reach a terminal, log or state file; filled as credentials are loaded.
_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()


def register_secret(value: str | None) -> None:
    """Remember a value so that `scrub()` hides it from every message.

    register_secret(os.environ.get("AWS_SECRET_ACCESS_KEY"))
    """
    if value and len(value) >= 4:
        with _SECRETS_LOCK:
            _SECRETS.add(value)


def scrub(text: str) -> str:
    """Replace every registered secret in `text` with `****`.

    print(scrub(str(exc)))
    """
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, "****")
    return text


F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = ExitCode.FAILED) -> NoReturn:
    """Print `error: message` (scrubbed) on stderr and exit with `code`."""
    print(f"error: {scrub(message)}", file=sys.stderr, flush=True)
    sys.exit(code)


def cli_errors(fn: F | None = None, *, interrupted: str = "interrupted") -> Any:
    """Decorate a click command: an HgxserveError becomes `error: ...` on stderr and its exit
    code; Ctrl-C prints `interrupted` and exits 130; no traceback either way.

    @cli_errors                                   # or @cli_errors(interrupted="...kept")
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except HgxserveError as exc:
                fail(str(exc), exc.exit_code)
            except KeyboardInterrupt:
                print(interrupted, file=sys.stderr, flush=True)
                sys.exit(ExitCode.INTERRUPTED)

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate
