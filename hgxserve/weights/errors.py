"""Errors of the weights commands, each with its documented exit code.

raise SourceError("s3://models/x/: endpoint http://127.0.0.1:9 refused the connection")
"""

from __future__ import annotations

from hgxserve.base.errors import ExitCode, HgxserveError

# Exit codes (README "Exit codes"; engine units and the pyinfra role rely on them).
EXIT_VERIFY_FAILED = ExitCode.FOUND  # content mismatch, missing/truncated file, marker stale
EXIT_USAGE = ExitCode.USAGE
EXIT_SOURCE = ExitCode.SOURCE  # S3/endpoint/source directory unreachable or failing
EXIT_CREDENTIALS = ExitCode.CREDENTIALS
EXIT_LOCAL_IO = ExitCode.LOCAL_IO


class WeightsError(HgxserveError):
    """Base of the weights errors; each subclass has its exit code."""

    exit_code = EXIT_SOURCE


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
