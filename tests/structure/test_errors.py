"""One error contract: every command reports an HgxserveError as one `error:` line (secrets
scrubbed) and the exit code of the table in the README; no tracebacks."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from hgxserve.base.errors import ExitCode, HgxserveError, cli_errors, register_secret
from hgxserve.caches.archive import ArchiveError
from hgxserve.caches.bake import BakeError
from hgxserve.caches.hostfacts import FactsError
from hgxserve.cli.caches import cache
from hgxserve.cli.release import release
from hgxserve.cli.render import render
from hgxserve.gpus.checks import GpuQueryError
from hgxserve.proxy.config import ProxyConfigError
from hgxserve.release.gate import GateError
from hgxserve.release.store import ReleaseError
from hgxserve.render.types import RenderError
from hgxserve.weights.errors import (
    CredentialsError,
    LocalIOError,
    SourceError,
    UsageError,
    VerifyError,
)

EXIT_CODES: dict[int, tuple[type[HgxserveError], ...]] = {
    ExitCode.FOUND: (VerifyError, GateError, ProxyConfigError),
    ExitCode.USAGE: (UsageError, FactsError, GpuQueryError),
    ExitCode.SOURCE: (SourceError,),
    ExitCode.CREDENTIALS: (CredentialsError,),
    ExitCode.LOCAL_IO: (LocalIOError,),
    ExitCode.FAILED: (ReleaseError, RenderError, ArchiveError, BakeError),
}


@pytest.mark.parametrize(
    ("error", "code"), [(error, code) for code, errors in EXIT_CODES.items() for error in errors]
)
def test_each_error_has_its_exit_code(error: type[HgxserveError], code: int) -> None:
    @click.command()
    @cli_errors
    def cmd() -> None:
        raise error("it broke", hint="try again")

    result = CliRunner().invoke(cmd, [])
    assert result.exit_code == code
    assert result.output == "error: it broke\n  hint: try again\n"


def test_messages_are_scrubbed_and_interrupts_exit_130() -> None:
    register_secret("s3cr3t-value")

    @click.command()
    @cli_errors
    def leaky() -> None:
        raise HgxserveError("endpoint rejected key s3cr3t-value")

    result = CliRunner().invoke(leaky, [])
    assert result.exit_code == ExitCode.FAILED and "s3cr3t" not in result.output

    @click.command()
    @cli_errors(interrupted="stopped, nothing lost")
    def slow() -> None:
        raise KeyboardInterrupt

    result = CliRunner().invoke(slow, [])
    assert result.exit_code == 130 and result.output == "stopped, nothing lost\n"


def test_release_errors_exit_6_and_name_the_release(tmp_path) -> None:
    result = CliRunner().invoke(release, ["confirm", "abc123", "--root", str(tmp_path)])
    assert result.exit_code == ExitCode.FAILED
    assert "error: " in result.output and "abc123" in result.output
    assert "Traceback" not in result.output


def test_render_unreadable_file_exits_2_like_validate(tmp_path) -> None:
    missing = tmp_path / "nope.yml"
    result = CliRunner().invoke(render, [str(missing), "--out", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.USAGE
    broken = tmp_path / "broken.yml"
    broken.write_text("hosts: [unclosed\n")
    result = CliRunner().invoke(render, [str(broken), "--out", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.USAGE


def test_cache_scan_tells_jit_found_from_an_error(tmp_path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("x TileLang begins to compile kernel `k` with `out_idx=[-1]`\n")
    assert CliRunner().invoke(cache, ["scan", str(log)]).exit_code == ExitCode.FOUND
    missing = CliRunner().invoke(cache, ["scan", str(tmp_path / "missing.log")])
    assert missing.exit_code == ExitCode.USAGE
    bad = CliRunner().invoke(
        cache, ["restore", "--archive", str(log), "--dir", str(tmp_path / "k")]
    )
    assert bad.exit_code == ExitCode.FAILED
