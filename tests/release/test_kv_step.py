"""The deploy's KV capacity step: each switched host checks its engines' record against the
needs the controller computed; `fail` turns a short engine into the release's failed verdict
(named on every host by the settle), `warn` only says it, `off` checks nothing."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hgxserve.cli.release import release
from hgxserve.operations.release import check_kv, run_gate
from hgxserve.release.coordination import Coordination, RunPlan
from hgxserve.release.store import Store

UNIT = "hgxserve-decode-0.service"
NEED = {
    "engine": "decode-0",
    "need_tokens": 288,
    "shape": "warm-up 128x16x2: 2 x (128+16)",
    "dp": 1,
    "fit_tokens": None,
}


class _Output:
    def __init__(self, stdout: str, stderr: str) -> None:
        self.stdout_lines = stdout.splitlines()
        self.stderr_lines = stderr.splitlines()


class _Host:
    """A pyinfra host whose agent is this process's `hgxserve release` command."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.said: list[tuple[str, Any]] = []
        self.commands: list[str] = []

    def run_shell_command(self, command: str) -> tuple[bool, _Output]:
        self.commands.append(command)
        argv = shlex.split(command)
        assert argv[1] == "release", argv
        result = CliRunner().invoke(release, argv[2:])
        return result.exit_code == 0, _Output(result.stdout, result.stderr)

    def log_styled(self, message: str, **kw: Any) -> None:
        self.said.append((message, kw.get("fg")))


class _State:
    failed_hosts: list[_Host] = []


@pytest.fixture
def root(tmp_path: Path) -> str:
    store = Store(str(tmp_path / "lib"))
    (store.release_dir("r1") / "tree").mkdir(parents=True)
    store.note_observed("r1", UNIT, {"start_s": 4.2, "kv_tokens": 128, "kv_source": "metrics"})
    return str(store.root)


def _coord(policy: str) -> Coordination:
    switching = {"hgx-b": "r1", "hgx-c": "r1"}
    return Coordination(
        RunPlan(switching=switching, kv_needs={"hgx-b": {UNIT: NEED}}, kv_policy=policy)
    )


def test_fail_policy_makes_a_short_engine_the_release_verdict(root: str) -> None:
    coord, host, gate_host = _coord("fail"), _Host("hgx-b"), _Host("hgx-c")
    assert check_kv(_State(), gate_host, coord, "r1", root)  # no engine of its own to check
    assert gate_host.commands == []
    assert check_kv(_State(), host, coord, "r1", root)
    assert any(m.startswith("KV SHORT: decode-0") and fg == "red" for m, fg in host.said)
    why = coord.record.kv_short["hgx-b"]
    assert why.startswith("hgx-b: KV capacity below the topology's shapes: decode-0")
    assert "holds 128 KV tokens" in why and "below the 288" in why
    assert run_gate(_State(), gate_host, coord, "r1", root)
    assert coord.record.verdict == (False, why)
    assert gate_host.commands == []  # the probes are not sent to a release that fails anyway
    record = Store(root).observed("r1")[UNIT]
    assert record["kv_verdict"] == "short" and record["kv_need_tokens"] == 288


def test_warn_policy_says_it_and_the_gate_runs(root: str) -> None:
    coord, host = _coord("warn"), _Host("hgx-b")
    assert check_kv(_State(), host, coord, "r1", root)
    assert coord.record.kv_short == {}
    assert any(m.startswith("KV SHORT: decode-0") and fg == "yellow" for m, fg in host.said)
    assert "--policy warn" in host.commands[0]
    assert Store(root).observed("r1")[UNIT]["kv_verdict"] == "short"


def test_off_policy_checks_nothing(root: str) -> None:
    coord, host = _coord("off"), _Host("hgx-b")
    assert check_kv(_State(), host, coord, "r1", root)
    assert host.commands == [] and coord.record.kv_short == {}
    assert "kv_verdict" not in Store(root).observed("r1")[UNIT]


def test_kv_check_command_refuses_a_malformed_need(root: str) -> None:
    result = CliRunner().invoke(release, ["kv-check", "r1", "--need", "[1]", "--root", root])
    assert result.exit_code != 0 and "--need" in result.output + (result.stderr or "")
