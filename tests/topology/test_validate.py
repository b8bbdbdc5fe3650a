"""Golden cases for `hgxserve validate`: every invalid case prints exactly its .expected lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.cli.topology import validate
from hgxserve.topology import check_topology
from hgxserve.topology.rules import RULES

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
INVALID = sorted((HERE / "invalid").glob("*.yml"))
VALID = sorted((HERE / "valid").glob("*.yml"))
EXAMPLES = sorted((REPO / "topologies").rglob("*.yml"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _expected_exit(path: Path) -> int:
    match = re.search(r"^# expect-exit: (\d)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} lacks an '# expect-exit: N' header"
    return int(match.group(1))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def test_enough_cases() -> None:
    assert len(INVALID) >= 30


@pytest.mark.parametrize("case", INVALID, ids=lambda p: p.stem)
def test_invalid_case_prints_expected_lines(case: Path) -> None:
    expected = case.with_suffix(".expected").read_text()
    result = CliRunner().invoke(validate, [_rel(case)])
    assert result.output == expected
    assert result.exit_code == _expected_exit(case)
    assert "Traceback" not in result.output


def test_every_rule_has_a_failing_case() -> None:
    fired = {p.rule for case in INVALID for p in check_topology(_rel(case)).problems}
    missing = sorted(set(RULES) - fired)
    assert not missing, f"rules without an invalid case: {missing}"
    assert {"schema", "duplicate-key", "parse"} <= fired


@pytest.mark.parametrize("case", VALID, ids=lambda p: p.stem)
def test_valid_case_has_no_problems(case: Path) -> None:
    result = check_topology(_rel(case))
    assert [p.text() for p in result.problems] == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: _rel(p))
def test_example_topologies_have_no_errors(example: Path) -> None:
    result = check_topology(_rel(example))
    assert result.topology is not None
    assert [p.text() for p in result.errors] == []


def test_examples_include_the_seed_shapes() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {
        "h20-v4flash-tp8",
        "h20-v4flash-4p4d",
        "h20-v4flash-1p1d-2node",
        "h200-dsv32-2p1d",
        "h200-dsv32-tp8",
        "h200-dsv32-sglang-dp8",
        "demo-baseline",
        "demo-pd",
    } <= names
    baselines = {p.stem for p in EXAMPLES if check_topology(_rel(p)).topology.baseline}  # type: ignore[union-attr]
    assert {"h20-v4flash-tp8", "h200-dsv32-tp8", "demo-baseline"} <= baselines


# -- exit codes and formats ----------------------------------------------------------------------

GOOD = "topologies/demo/demo-pd.yml"
WARN = "tests/topology/invalid/heads-per-rank.yml"
BAD = "tests/topology/invalid/pd-tp.yml"
BROKEN = "tests/topology/invalid/yaml-syntax.yml"


@pytest.mark.parametrize(
    ("args", "code"),
    [
        ([GOOD], 0),
        ([WARN], 0),
        (["--strict", WARN], 1),
        (["--strict", GOOD], 0),
        ([BAD], 1),
        ([GOOD, BAD], 1),
        ([BROKEN], 2),
        ([BAD, BROKEN], 2),
        (["does/not/exist.yml"], 2),
    ],
)
def test_exit_codes(args: list[str], code: int) -> None:
    result = CliRunner().invoke(validate, args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output


def test_problems_of_several_files_are_sorted_with_a_summary() -> None:
    result = CliRunner().invoke(validate, [WARN, BAD, GOOD])
    lines = result.output.splitlines()
    # heads-per-rank.yml warns on its heads, and both cases on their keyless proxy on 0.0.0.0
    assert lines[-1] == "3 files checked: 2 valid, 1 invalid; 1 error, 3 warnings"
    assert lines[:-1] == sorted(lines[:-1])
    assert any(": warning: " in line for line in lines)


def test_missing_file_is_reported_not_raised() -> None:
    result = CliRunner().invoke(validate, ["does/not/exist.yml"])
    assert result.output.splitlines()[0] == (
        "does/not/exist.yml:1:1: $: cannot read file: No such file or directory"
    )


def test_json_format_parses() -> None:
    result = CliRunner().invoke(validate, ["--format", "json", WARN, BAD, BROKEN])
    data = json.loads(result.output)
    assert result.exit_code == 2 and data["exit_code"] == 2
    by_file = {f["file"]: f for f in data["files"]}
    assert by_file[BROKEN]["unreadable"] is True
    assert by_file[WARN]["valid"] is True and by_file[WARN]["warnings"] == 2
    problem = by_file[BAD]["problems"][0]
    assert problem["path"] == "$.engines.decode-0.tp"
    assert (problem["line"], problem["col"], problem["rule"]) == (27, 9, "pd-tp")
    assert problem["severity"] == "error"


def test_unexpected_exception_is_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(path: str) -> None:
        raise RuntimeError("kaput")

    monkeypatch.setattr("hgxserve.topology.results.check_topology", boom)
    result = CliRunner().invoke(validate, [GOOD])
    assert result.exit_code == 2
    assert result.output.splitlines()[0] == (
        f"{GOOD}:1:1: $: internal error while checking this file: RuntimeError: kaput"
    )
    assert "Traceback" not in result.output


def test_list_rules() -> None:
    result = CliRunner().invoke(validate, ["--list-rules"])
    assert result.exit_code == 0
    ids = [line.split()[0] for line in result.output.splitlines()]
    assert ids == sorted(RULES)
    data = json.loads(CliRunner().invoke(validate, ["--list-rules", "--format", "json"]).output)
    assert {r["id"]: r["severity"] for r in data}["pd-tp"] == "error"


def test_no_files_is_a_usage_error() -> None:
    result = CliRunner().invoke(validate, [])
    assert result.exit_code == 2
    assert "give at least one topology file" in result.output


def test_installed_command_runs_for_real() -> None:
    exe = Path(sys.executable).parent / "hgxserve"
    assert exe.exists(), exe
    ok = subprocess.run(
        [str(exe), "validate", GOOD, "--strict"], capture_output=True, text=True, cwd=REPO
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip() == "1 file checked: 1 valid, 0 invalid; 0 errors, 0 warnings"
    bad = subprocess.run([str(exe), "validate", BAD], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1
    assert bad.stdout == (REPO / BAD).with_suffix(".expected").read_text()
    broken = subprocess.run(
        [str(exe), "validate", BROKEN], capture_output=True, text=True, cwd=REPO
    )
    assert broken.returncode == 2 and "Traceback" not in broken.stderr


def test_schema_alone_refuses_a_trailing_newline_after_a_prefix_pattern() -> None:
    """`^/` (a prefix pattern) must not let "/x\\n" through, even without the loader's check."""
    from hgxserve.topology.loader import Document
    from hgxserve.topology.schema import schema_problems

    model = {"name": "m", "served_name": "m", "path": "/x\n", "source": {"local": {"path": "/m"}}}
    doc = Document("t.yml", {"name": "t", "hosts": {}, "model": model, "engines": {}})
    assert any(p.path == ("model", "path") for p in schema_problems(doc))
    model["path"] = "/x"
    assert not any(p.path == ("model", "path") for p in schema_problems(doc))
    doc.data["name"] = "t\n"  # an anchored pattern (`^[a-z0-9]...$`): \Z, not Python's `$`
    assert any(p.path == ("name",) for p in schema_problems(doc))
