"""The deploy layer stays thin and its `--data` keys stay in one table.

- deploys/*.py import only `hgxserve.deploy` (a stage's plan), roles, and pyinfra's `host`,
  `inventory`, `local` and `logger`; they read no host data themselves, define nothing, and stay
  within MAX_STATEMENTS statements: short lists of role calls, each handing its role the plan
  (or the part of it the role runs) rather than the plan's fields one by one.
- every key read from pyinfra host data anywhere in hgxserve/, roles/ and deploys/ is a row of
  `hgxserve.deploy.data.KEYS` (pyinfra's own `ssh_*` connection keys aside), and every row is read.
- the table's booleans follow the one rule; its defaults fit their own types.
- docs/deploy-data.md is `hgxserve deploy-data --format markdown`, and the README names it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from pyinfra.api import DeployError

from hgxserve.cli.deploy import deploy_data
from hgxserve.deploy.data import KEYS, TABLE, DeployData, convert, parse_bool
from hgxserve.deploy.datadoc import as_markdown
from hgxserve.deploy.stages import STAGES

REPO = Path(__file__).resolve().parents[2]
DEPLOYS = sorted(p for p in (REPO / "deploys").glob("*.py") if p.name != "__init__.py")
# A deploy file is a plan and the role calls it feeds: statements outside the docstring and the
# imports, nested ones included (runtime.py, the longest, has 9).
MAX_STATEMENTS = 9
# A role takes its plan whole; provision.py's roles, each fed a few fields of the one plan they
# share, pass the most.
MAX_CALL_ARGUMENTS = 3
PYINFRA_NAMES = {"host", "inventory", "local", "logger"}
# Keys pyinfra itself reads (its SSH connector); hgxserve passes them on, never defines them.
PYINFRA_KEY_PREFIX = "ssh_"
# Functions that read host data by a computed key, and why.
COMPUTED_READS = {
    "connection_data": "copies pyinfra's SSH connection keys (CONNECTION_KEYS) for the bench",
}
STAGE_NAMES = {*STAGES, "site", "rollback"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _body(tree: ast.Module) -> list[ast.stmt]:
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the module docstring: the operator's documentation
    return [s for s in body if not isinstance(s, ast.Import | ast.ImportFrom)]


@pytest.mark.parametrize("path", DEPLOYS, ids=lambda p: p.name)
def test_deploys_import_only_the_stage_plans_roles_and_pyinfra(path):
    wrong = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            wrong += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {alias.name for alias in node.names}
            if module == "pyinfra" and names <= PYINFRA_NAMES:
                continue
            if module == "hgxserve.deploy" or module.startswith(("hgxserve.deploy.", "roles.")):
                continue
            wrong.append(f"from {module} import {', '.join(sorted(names))}")
    assert wrong == [], f"{path.name}: {wrong}"


@pytest.mark.parametrize("path", DEPLOYS, ids=lambda p: p.name)
def test_deploys_read_no_host_data_and_stay_short(path):
    tree = _tree(path)
    data_reads = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "data"
    ]
    assert data_reads == [], f"{path.name}: reads host data at lines {data_reads}"
    body = _body(tree)
    statements = [n for s in body for n in ast.walk(s) if isinstance(n, ast.stmt)]
    logic = [
        type(n).__name__
        for n in statements
        if isinstance(
            n,
            ast.FunctionDef | ast.ClassDef | ast.Try | ast.While | ast.With | ast.AsyncFunctionDef,
        )
    ]
    assert logic == [], f"{path.name}: {logic}: logic belongs in hgxserve/deploy/plans.py"
    assert len(statements) <= MAX_STATEMENTS, f"{path.name}: {len(statements)} statements"
    wide = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and len(node.args) + len(node.keywords) > MAX_CALL_ARGUMENTS
    ]
    assert wide == [], f"{path.name}: calls at lines {wide} unpack a plan: hand the role the plan"
    assert ast.get_docstring(tree), f"{path.name}: the module docstring is the operator's doc"


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_host(node: ast.AST) -> bool:
    """A pyinfra host: `host`, `h`, `*_host`, or `self.host`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "host"
    return isinstance(node, ast.Name) and (node.id in ("host", "h") or node.id.endswith("_host"))


def _is_host_data(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "data":
        return _is_host(node.value)
    return isinstance(node, ast.Name) and node.id in aliases


def host_data_reads(path: Path) -> tuple[set[str], list[str]]:
    """Keys read from pyinfra host data in `path` (`host.data.get("k")`, `host.data["k"]`,
    `host.data.k`, and the same through a local `data = host.data`), and the functions that
    read it by a computed key."""
    tree = _tree(path)
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_host_data(node.value, set())
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    owner: dict[ast.AST, str] = {}
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef):
            for node in ast.walk(func):
                owner[node] = func.name  # the innermost function wins: walked after its parent
    keys: set[str] = set()
    computed: list[str] = []
    for node in ast.walk(tree):
        name = owner.get(node, "<module>")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _is_host_data(node.func.value, aliases)
            and node.args
        ):
            key = _literal(node.args[0])
            keys.add(key) if key else computed.append(name)
        elif isinstance(node, ast.Subscript) and _is_host_data(node.value, aliases):
            key = _literal(node.slice)
            keys.add(key) if key else computed.append(name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "data"
            and _is_host(node.value.value)
            and isinstance(node.ctx, ast.Load)
            and node.attr not in ("get", "update", "items", "keys", "values")
        ):
            keys.add(node.attr)
    return keys, computed


def table_reads(path: Path) -> set[str]:
    """Keys read through the table's accessor: `data.get("k")` / `data.given("k")` where
    `data = deploy_data(host)`, or `deploy_data(host).get("k")`."""
    keys = set()
    for node in ast.walk(_tree(path)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        through_table = (isinstance(receiver, ast.Name) and receiver.id == "data") or (
            isinstance(receiver, ast.Call)
            and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "deploy_data"
        )
        if through_table and node.func.attr in ("get", "given") and node.args:
            key = _literal(node.args[0])
            if key:
                keys.add(key)
    return keys


def _product_files() -> list[Path]:
    return [
        p
        for pkg in ("hgxserve", "roles", "deploys")
        for p in sorted((REPO / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    ]


def test_every_host_data_key_is_in_the_table_and_every_row_is_read():
    direct: dict[str, str] = {}
    computed = []
    through_table: set[str] = set()
    for path in _product_files():
        keys, funcs = host_data_reads(path)
        for key in keys:
            direct[key] = str(path.relative_to(REPO))
        computed += [f"{path.relative_to(REPO)}:{f}" for f in funcs if f not in COMPUTED_READS]
        if path.parent.name == "deploy":
            through_table |= table_reads(path)
    ours = {k: where for k, where in direct.items() if not k.startswith(PYINFRA_KEY_PREFIX)}
    assert {k: w for k, w in ours.items() if k not in TABLE} == {}, "add them to KEYS"
    assert computed == [], "host data read by a computed key: name it in COMPUTED_READS"
    assert through_table - set(TABLE) == set()
    assert set(TABLE) - through_table - set(ours) == set(), "rows no stage reads"


def test_the_checks_find_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(host, k):\n"
        "    a = host.data.get('alpha', 1)\n"
        "    b = host.data['beta']\n"
        "    c = host.data.gamma\n"
        "    d = host.data\n"
        "    e = d.get('delta')\n"
        "    return host.data.get(k)\n"
    )
    assert host_data_reads(probe) == ({"alpha", "beta", "gamma", "delta"}, ["f"])
    deploy = tmp_path / "deploy.py"
    deploy.write_text('"""doc"""\nfrom hgxserve.topology import load_topology\n')
    with pytest.raises(AssertionError):
        test_deploys_import_only_the_stage_plans_roles_and_pyinfra(deploy)
    deploy.write_text('"""doc"""\nfrom pyinfra import host\nx = host.data.get("agent")\n')
    with pytest.raises(AssertionError):
        test_deploys_read_no_host_data_and_stay_short(deploy)
    deploy.write_text('"""doc"""\nrole(a=plan.a, b=plan.b, c=plan.c, d=plan.d)\n')
    with pytest.raises(AssertionError, match="unpack a plan"):
        test_deploys_read_no_host_data_and_stay_short(deploy)


# --- the table -------------------------------------------------------------------------------


def test_rows_are_well_formed():
    assert len(TABLE) == len(KEYS), "a key is listed twice"
    for key in KEYS:
        assert key.doc.strip() and key.stages, key.name
        assert set(key.stages) <= STAGE_NAMES, key.name
        assert (key.kind == "choice") <= bool(key.choices), key.name
        if key.default is not None:
            assert convert(key, key.default) == key.default, key.name  # defaults fit their type
        if key.kind == "choice" and key.default is not None:
            assert key.default in key.choices, key.name


@pytest.mark.parametrize("name", [k.name for k in KEYS if k.kind == "bool"])
def test_booleans_follow_the_one_rule(name):
    key = TABLE[name]
    assert isinstance(key.default, bool)
    for text in ("true", "TRUE", "Yes", "1", 1, True):
        assert convert(key, text) is True
    for text in ("false", "False", "NO", "0", 0, False):
        assert convert(key, text) is False
    for bad in ("off", "y", "2", 2, "maybe"):
        with pytest.raises(DeployError) as err:
            convert(key, bad)
        assert name in str(err.value) and repr(bad) in str(err.value)


def test_no_other_boolean_parsing_in_the_deploy_layer():
    """The deploy layer spells true/false words only in the table's one rule."""
    words = {"true", "false", "yes", "no"}
    found = []
    for pkg in ("deploys", "roles", "hgxserve/deploy"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path.name == "data.py" and path.parent.name == "deploy":
                continue
            for node in ast.walk(_tree(path)):
                if isinstance(node, ast.Tuple | ast.List | ast.Set):
                    texts = {_literal(e) for e in node.elts} - {None}
                    if {t.lower() for t in texts if t} & words:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_values_are_checked_with_messages_naming_key_and_value():
    data = DeployData(
        {
            "confirm_within": "soon",
            "health_timeout": -1,
            "fabric_manager": "sometimes",
            "stages": "weights,bake",
            "runtime_index_url": "mirror.lab",
            "load_now": "nope",
        }
    )
    expected = {
        "confirm_within": "--data confirm_within='soon': not a number",
        "health_timeout": "--data health_timeout=-1: must be greater than 0",
        "fabric_manager": "--data fabric_manager='sometimes': use auto, always or never",
        "stages": "--data stages='weights,bake': unknown bake; choose from preflight, provision",
        "runtime_index_url": "--data runtime_index_url='mirror.lab': not a URL",
        "load_now": "--data load_now='nope': not a boolean (use true/false, yes/no or 1/0)",
    }
    for name, message in expected.items():
        with pytest.raises(DeployError) as err:
            data.get(name)
        assert str(err.value).startswith(message), str(err.value)


def test_values_convert_and_defaults_apply(monkeypatch):
    data = DeployData(
        {"health_timeout": 75, "confirm_within": "120", "stages": "engines, weights", "agent": ""}
    )
    assert data.get("health_timeout") == 75.0
    assert data.get("confirm_within") == 120
    assert data.get("stages") == ("engines", "weights")  # site.py runs them in STAGES order
    assert data.get("agent") == TABLE["agent"].default  # empty: unset
    assert data.get("to") == "previous"
    assert parse_bool("x", " Yes ") is True
    monkeypatch.setenv("HGXSERVE_TOPOLOGY", "t.yml")
    assert data.get("topology") == "t.yml"
    assert DeployData({"topology": "u.yml"}).get("topology") == "u.yml"


# --- the table for operators -----------------------------------------------------------------


def test_the_doc_is_the_command_output():
    doc = (REPO / "docs" / "deploy-data.md").read_text(encoding="utf-8")
    result = CliRunner().invoke(deploy_data, ["--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert result.output == as_markdown()
    assert doc == result.output, "regenerate: hgxserve deploy-data --format markdown"
    assert all(f"| `{k.name}` |" in doc for k in KEYS)


def test_the_command_prints_every_key():
    runner = CliRunner()
    rows = json.loads(runner.invoke(deploy_data, ["--format", "json"]).output)
    assert [r["name"] for r in rows] == [k.name for k in KEYS]
    text = runner.invoke(deploy_data, []).output
    assert all(f"{k.name}  (" in text for k in KEYS)


def test_the_readme_names_the_command():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "hgxserve deploy-data" in readme and "docs/deploy-data.md" in readme
