"""Errors of the weights commands, each with its documented exit code.

raise SourceError("s3://models/x/: endpoint http://127.0.0.1:9 refused the connection")
"""

from __future__ import annotations

# Exit codes (docs/weights.md lists them; engine units and the pyinfra role rely on them).
EXIT_OK = 0
EXIT_VERIFY_FAILED = 1  # content mismatch, missing/truncated file, marker absent or stale
EXIT_USAGE = 2  # bad arguments (click's own code)
EXIT_SOURCE = 3  # S3/endpoint/source directory unreachable or failing after retries
EXIT_CREDENTIALS = 4  # credentials missing or rejected, access denied
EXIT_LOCAL_IO = 5  # local filesystem: disk full, permission, read-only
EXIT_INTERRUPTED = 130


class WeightsError(Exception):
    """Base of the errors the CLI turns into one clear line and an exit code."""

    exit_code = EXIT_SOURCE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class SourceError(WeightsError):
    """The source (S3 endpoint, bucket, prefix or source directory) failed."""

    exit_code = EXIT_SOURCE


class CredentialsError(WeightsError):
    """Credentials are missing, malformed or rejected."""

    exit_code = EXIT_CREDENTIALS


class VerifyError(WeightsError):
    """Content does not match the manifest or checksum."""

    exit_code = EXIT_VERIFY_FAILED


class LocalIOError(WeightsError):
    """The destination filesystem failed (ENOSPC, EACCES, EROFS...)."""

    exit_code = EXIT_LOCAL_IO


class UsageError(WeightsError):
    """Arguments that cannot work together."""

    exit_code = EXIT_USAGE
