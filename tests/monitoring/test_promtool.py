"""The rendered Prometheus config and rules pass promtool, and every alert has a unit test.

`promtool` comes from Debian's `prometheus` package (scripts/system-packages.sh installs it);
where it is missing these tests skip with that reason.

promtool compares annotations too, and ours are long runbook lines: the unit tests run on a
copy of the rules without annotations (their templates are checked by `promtool check rules`,
their presence by test_every_alert_has_a_runbook).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from hgxserve.monitoring.promtool import promtool_checks
from hgxserve.monitoring.render import render_tree
from hgxserve.topology import load_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MONITORED = HERE / "demo-pd-monitored.yml"
TOPOLOGIES = sorted(
    [*REPO.glob("topologies/*.yml"), *REPO.glob("topologies/demo/*.yml"), MONITORED]
)
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool missing: apt-get install prometheus (scripts/system-packages.sh)",
)


def write_tree(out: Path, topology: Path) -> dict[str, str]:
    tree = render_tree(load_topology(str(topology)))
    for rel, text in tree.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    return tree


def rules_of(tree: dict[str, str]) -> dict:
    (rel,) = [p for p in tree if p.startswith("prometheus/hgxserve/rules/")]
    return YAML(typ="safe").load(tree[rel])


@needs_promtool
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda p: p.stem)
def test_promtool_checks_config_and_rules(tmp_path: Path, topology: Path) -> None:
    write_tree(tmp_path, topology)
    for cmd, proc in promtool_checks(tmp_path):
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}{proc.stderr}"
        assert "SUCCESS" in proc.stdout + proc.stderr


@needs_promtool
def test_every_alert_fires_in_promtool_unit_tests(tmp_path: Path) -> None:
    tree = write_tree(tmp_path, MONITORED)
    rules = rules_of(tree)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    with (tmp_path / "rules.yml").open("w") as out:
        yaml.dump(rules, out)
    shutil.copy(HERE / "alerts.test.yml", tmp_path / "alerts.test.yml")
    proc = subprocess.run(
        ["promtool", "test", "rules", "alerts.test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr
    # every alert the topology renders has a case where it fires
    tests = YAML(typ="safe").load((HERE / "alerts.test.yml").read_text())
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts - fired == set()


def test_every_alert_has_a_runbook() -> None:
    for topology in TOPOLOGIES:
        rules = rules_of(render_tree(load_topology(str(topology))))
        for group in rules["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    notes = rule["annotations"]
                    assert notes["runbook"] and notes["summary"], rule["alert"]
                    assert rule["labels"]["severity"] in ("critical", "warning")


@needs_promtool
def test_render_check_runs_promtool(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "monitoring", "render", str(MONITORED),
         "-o", str(tmp_path), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "$ promtool check config prometheus.yml" in proc.stdout
    assert "SUCCESS: prometheus.yml is valid prometheus config file syntax" in proc.stdout
    # a rule promtool refuses: exit 1 with promtool's words
    rules = tmp_path / "prometheus/hgxserve/rules/demo-pd.rules.yml"
    rules.write_text(rules.read_text().replace("expr: vector(4)", "expr: vector(4", 1))
    proc = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "monitoring", "render", str(MONITORED),
         "-o", str(tmp_path / "again"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0  # a fresh render is valid again
    from hgxserve.monitoring.promtool import promtool_checks as checks

    failed = [cmd for cmd, p in checks(tmp_path) if p.returncode != 0]
    assert failed and failed[0][:3] == ["promtool", "check", "config"]
