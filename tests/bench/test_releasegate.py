"""The release's SLA gate (`gate.bench:`), the parts the e2e test does not vary: which release
holds the reference result, the bench process's inventory, the verdicts a miss, a failure and
a regression give (the last through the real `hgxserve bench compare`)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from hgxserve.bench import releasegate
from hgxserve.release.coordination import Coordination, RunPlan, RunRecord
from hgxserve.remote.inventory import load_inventory
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.bench.test_figures import _fake_run  # noqa: E402


class _Output:
    def __init__(self, stdout: str) -> None:
        self.stdout_lines = stdout.splitlines()
        self.stderr_lines: list[str] = []


class _Host:
    """A pyinfra host whose shell is this machine's (`cat`, `mkdir`), files under `root`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.said: list[str] = []

    def run_shell_command(self, command: str) -> tuple[bool, _Output]:
        proc = subprocess.run(command, shell=True, capture_output=True, text=True)
        return proc.returncode == 0, _Output(proc.stdout)

    def put_file(self, src: Any, dest: str) -> bool:
        Path(dest).write_bytes(src.read())
        return True

    def log_styled(self, message: str, **kw: object) -> None:
        self.said.append(message)


class _Inventory:
    def __init__(self, hosts: dict[str, _Host]) -> None:
        self.hosts = hosts

    def get_host(self, name: str, default: object = None) -> object:
        return self.hosts.get(name, default)


class _State:
    def __init__(self, hosts: dict[str, _Host]) -> None:
        self.inventory = _Inventory(hosts)


def test_the_reference_is_the_release_that_ran_the_gate() -> None:
    states = {
        "hgx-a": {"current": "aaa", "gate_current": False},
        "hgx-c": {"current": "ccc", "gate_current": True},
        "hgx-b": {"current": None},
    }
    assert releasegate.previous_gate(states) == ("hgx-c", "ccc")
    assert releasegate.previous_gate({"hgx-a": {"current": "aaa"}}) is None


def test_the_bench_process_gets_the_hosts_ssh_settings(tmp_path: Path) -> None:
    connections = {
        "hgx-c": {"ssh_hostname": "10.77.0.13", "ssh_port": 22, "ssh_key": "/k/id",
                  "ssh_strict_host_key_checking": "no", "ssh_paramiko_connect_kwargs": {"a": 1}},
        "hgx-a": {"ssh_user": "o'brien"},
    }  # fmt: skip
    path = releasegate._inventory_file(tmp_path, connections)
    assert path.stat().st_mode & 0o777 == 0o600
    inv = load_inventory(str(path))
    assert {n: h.data for n, h in inv.hosts.items()} == connections
    step = releasegate.BenchStep("topologies/demo/demo-pd.yml", "tight", 300, tokenizer="/tok")
    argv = releasegate.bench_argv(step, inventory=path, from_host="hgx-c", release_id="hgx-c=ccc",
                                key_files={"--api-key-file": None})  # fmt: skip
    assert argv[1:5] == ["bench", "run", "topologies/demo/demo-pd.yml", "--scenario"]
    joined = shlex.join(argv)
    assert "--from hgx-c" in joined and "--round-timeout 240" in joined
    assert "--tokenizer /tok" in joined and "--api-key-file" not in joined


def test_a_miss_names_the_figure_and_a_failure_names_the_error() -> None:
    lines = ["bench ...", "SLA missed: tight c2: TPOT p90 10.4 ms, SLA <= 2 ms", "run: x"]
    assert releasegate._failure(1, lines) == (
        "bench SLA missed: tight c2: TPOT p90 10.4 ms, SLA <= 2 ms"
    )
    lines = ["error: round tight-c2-s0 refused: still busy after 20 s: proxy outstanding 2"]
    assert releasegate._failure(6, lines) == (
        "the bench could not run (exit 6): round tight-c2-s0 refused: still busy after 20 s: "
        "proxy outstanding 2"
    )


def _kept(root: Path, release_id: str, run: dict) -> Path:
    where = root / "releases" / release_id / releasegate.RESULT_DIR
    where.mkdir(parents=True)
    (where / "run.json").write_text(json.dumps(run))
    return where


def _gate(
    hosts: dict, coord: Coordination, step: releasegate.BenchStep, root: Path, work: Path
) -> releasegate._Gate:
    """The gate's host is hgx-c."""
    return releasegate._Gate(_State(hosts), hosts["hgx-c"], coord, step, str(root), work)  # type: ignore[arg-type]


def test_a_regression_past_the_margin_fails_the_gate(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _kept(root, "old111", _fake_run("old", ttft=20.0, tput=2.0))
    new = tmp_path / "new"
    new.mkdir()
    (new / "run.json").write_text(json.dumps(_fake_run("new", ttft=30.0, tput=2.0)))
    hosts = {"hgx-c": _Host("hgx-c")}
    step = releasegate.BenchStep("t.yml", "long", 300, max_regression_pct=10,
                               previous=("hgx-c", "old111"))  # fmt: skip
    coord = Coordination(RunPlan(), RunRecord(verdict=(True, "GATE-OK")))
    work = tmp_path / "work"
    work.mkdir()
    releasegate._regression(_gate(hosts, coord, step, root, work), new)
    assert coord.record.verdict is not None and coord.record.verdict[0] is False
    assert coord.record.verdict[1].startswith(
        "gate failed: bench regressed more than 10% against release old111: new long c1: "
        "TTFT p50 ms 32.00 vs 22.00 (+45.5%, margin 10%)"
    ), coord.record.verdict
    # within the margin: the verdict stands
    coord = Coordination(RunPlan(), RunRecord(verdict=(True, "GATE-OK")))
    step.max_regression_pct = 60
    releasegate._regression(_gate(hosts, coord, step, root, work / "b"), new)
    assert coord.record.verdict == (True, "GATE-OK")
    # a kept result of another scenario: nothing to compare, said, not failed
    other = _fake_run("other", ttft=20.0, tput=2.0)
    for point in other["points"]:
        point["scenario"] = "renamed"
    _kept(root, "other444", other)
    coord = Coordination(RunPlan(), RunRecord(verdict=(True, "GATE-OK")))
    step.max_regression_pct, step.previous = 10, ("hgx-c", "other444")
    releasegate._regression(_gate(hosts, coord, step, root, work / "d"), new)
    assert coord.record.verdict == (True, "GATE-OK")
    assert "has no point of scenario long at this run's loads" in hosts["hgx-c"].said[-1]
    # no kept result of the last confirmed release: said, not failed
    coord = Coordination(RunPlan(), RunRecord(verdict=(True, "GATE-OK")))
    step.previous = ("hgx-c", "gone222")
    releasegate._regression(_gate(hosts, coord, step, root, work / "c"), new)
    assert coord.record.verdict == (True, "GATE-OK")
    assert "no kept result of the last confirmed release (hgx-c release gone222)" in \
        hosts["hgx-c"].said[-1]  # fmt: skip


def test_the_result_is_kept_beside_the_release(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"passed": false}\n')
    (run_dir / "report.md").write_text("# report\n")
    root = tmp_path / "store"
    (root / "releases" / "new333").mkdir(parents=True)
    dest = releasegate._keep(_Host("hgx-c"), "new333", str(root), run_dir)  # type: ignore[arg-type]
    assert dest == f"{root}/releases/new333/bench"
    assert json.loads(Path(dest, "run.json").read_text()) == {"passed": False}
    assert Path(dest, "report.md").read_text() == "# report\n"


def test_no_bench_step_without_gate_bench() -> None:
    topo = load_topology(REPO / "topologies/demo/demo-pd.yml")
    assert topo.gate.bench is None
    assert releasegate.bench_step_for(topo, topo.source_file, [], None) is None
