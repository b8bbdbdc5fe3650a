"""hgxserve.topology.rules: one module per rule family. Every module of the package is in
RULE_MODULES (or is `common`, which registers nothing), each registers a rule at least, and
every rule it registers belongs to its declared FAMILY, the family of no other module."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import hgxserve.topology.rules as rules_package
from hgxserve.topology.rules import RULE_MODULES, RULES

PACKAGE = Path(rules_package.__file__).parent
HELPERS = ("common",)  # shared helpers: no rules
MAX_LINES = 450


def _in_family(rule_id: str, family: tuple[str, ...]) -> bool:
    return any(rule_id == f or (f.endswith("-") and rule_id.startswith(f)) for f in family)


def _short(module: ModuleType) -> str:
    return module.__name__.rpartition(".")[2]


def test_every_module_of_the_package_is_registered() -> None:
    files = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    listed = sorted(_short(m) for m in RULE_MODULES)
    missing = [f for f in files if f not in listed and f not in HELPERS]
    assert missing == [], f"add to RULE_MODULES in hgxserve/topology/rules/__init__.py: {missing}"
    assert len(listed) == len(set(listed))


def test_every_registered_module_registers_a_rule() -> None:
    owners = {r.check.__module__ for r in RULES.values()}
    idle = [m.__name__ for m in RULE_MODULES if m.__name__ not in owners]
    assert idle == [], f"registered modules without a rule: {idle}"
    assert owners == {m.__name__ for m in RULE_MODULES}, "a rule registered outside RULE_MODULES"


def test_helpers_register_no_rule() -> None:
    for name in HELPERS:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
        imported = {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assert not imported & {"rule", "engine_rule", "proxy_rule"}, name


def test_each_rule_is_in_its_modules_family_and_no_other() -> None:
    families = {m.__name__: tuple(m.FAMILY) for m in RULE_MODULES}
    wrong = []
    for rule_id, r in sorted(RULES.items()):
        homes = [name for name, family in families.items() if _in_family(rule_id, family)]
        if homes != [r.check.__module__]:
            wrong.append(f"{rule_id}: registered in {r.check.__module__}, family of {homes}")
    assert wrong == []


def test_each_family_entry_names_a_rule() -> None:
    for module in RULE_MODULES:
        for entry in module.FAMILY:
            assert any(_in_family(rule_id, (entry,)) for rule_id in RULES), (
                f"{module.__name__}.FAMILY: {entry!r} matches no rule"
            )


def test_the_docstring_names_the_family() -> None:
    for module in RULE_MODULES:
        first = (module.__doc__ or "").split("\n\n", 1)[0]
        for entry in module.FAMILY:
            shown = f"{entry}*" if entry.endswith("-") else entry
            assert shown in first, f"{module.__name__}: docstring does not name {shown}"


def test_no_module_is_over_the_limit() -> None:
    long = {
        p.name: n
        for p in PACKAGE.glob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}
