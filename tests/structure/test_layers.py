"""The layers (README "Architecture"): each module imports only its own layer and those below,
never upwards, and no two modules import each other, directly or around a loop. Every module
also imports on its own (no hidden dependence on what another import loaded first)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from imports import cycles, import_graph, modules

REPO_ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A module belongs to the first layer one of whose prefixes it matches.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("hgxserve", "hgxserve.base")),  # `hgxserve` itself: __version__ only
    (
        "topology and leaf libraries",
        (
            "hgxserve.topology",
            "hgxserve.parsers",
            "hgxserve.proxy",
            "hgxserve.weights",
            "hgxserve.remote",
        ),
    ),
    # the GPU checks read nvidia-smi through hgxserve.parsers
    ("caches, runtimes and GPU checks", ("hgxserve.caches", "hgxserve.runtime", "hgxserve.gpus")),
    ("render", ("hgxserve.render",)),
    ("monitoring", ("hgxserve.monitoring",)),
    ("release", ("hgxserve.release",)),
    # pyinfra facts (FactBase), then the operations that read them, as pyinfra lays out its own
    ("pyinfra facts", ("hgxserve.facts",)),
    ("pyinfra operations", ("hgxserve.operations",)),
    ("status and bench", ("hgxserve.status", "hgxserve.bench")),
    ("plan", ("hgxserve.plan",)),  # `plan`'s report: reads render, release and bench
    ("deploy", ("hgxserve.deploy",)),  # the --data table and the stage plans
    ("tune", ("hgxserve.tune",)),  # deploy -> bench -> compare candidate topologies
    ("command line", ("hgxserve.cli",)),  # the root group and one module per command group
    ("roles", ("roles",)),
    ("deploys", ("deploys",)),
]


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "hgxserve" and module.startswith(prefix + ".")):
                return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and the README")


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{src} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]})"
        for src, targets in sorted(import_graph().items())
        for dst in sorted(targets)
        if layer_of(dst) > layer_of(src)
    ]
    assert upward == []


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] != "hgxserve" else ".".join(parts[:2])


# Imports between packages of one layer: the few the README names, no others.
SAME_LAYER: set[tuple[str, str]] = set()


def test_packages_of_one_layer_import_each_other_only_where_named():
    found = {
        (_package(src), _package(dst))
        for src, targets in import_graph().items()
        for dst in targets
        if layer_of(src) == layer_of(dst)
        and _package(src) != _package(dst)
        and LAYERS[layer_of(src)][0] not in ("command line", "roles", "deploys")
    }
    assert found <= SAME_LAYER, sorted(found - SAME_LAYER)


def _in_cli(module: str) -> bool:
    return module == "hgxserve.cli" or module.startswith("hgxserve.cli.")


def test_only_the_command_line_imports_its_modules():
    """hgxserve/cli/ holds every command: no library module, role or deploy imports it, and
    its command modules import no other command module (they share `hgxserve.cli.options`)."""
    graph = import_graph()
    outside = [
        f"{src} imports {dst}"
        for src, targets in sorted(graph.items())
        if not _in_cli(src)
        for dst in sorted(targets)
        if _in_cli(dst)
    ]
    assert outside == []
    shared = {"hgxserve.cli", "hgxserve.cli.options"}
    between = [
        f"{src} imports {dst}"
        for src, targets in sorted(graph.items())
        if _in_cli(src)
        for dst in sorted(targets)
        if _in_cli(dst) and dst not in shared
    ]
    assert between == []


def test_every_command_lives_in_the_command_line_package():
    from hgxserve.cli import COMMANDS

    for name, (target, _) in COMMANDS.items():
        module, _, attr = target.partition(":")
        assert module.startswith("hgxserve.cli."), f"{name}: {module} is not in hgxserve/cli/"
        assert hasattr(importlib.import_module(module), attr), f"{name}: no {target}"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_find_what_they_look_for():
    graph = {name: set(targets) for name, targets in import_graph().items()}
    graph["hgxserve.topology.model"].add("hgxserve.render")
    assert any("hgxserve.render" in c and "hgxserve.topology.model" in c for c in cycles(graph))
    assert layer_of("hgxserve.topology.model") < layer_of("hgxserve.render")
    assert layer_of("hgxserve.cli.weights") == layer_of("hgxserve.cli")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("hgxserve.newthing")


def _project_modules() -> list[str]:
    # deploy files are pyinfra deploy scripts: they run only inside a pyinfra run
    return sorted(m for m in modules() if not m.startswith("deploys"))


@pytest.mark.parametrize("module", _project_modules())
def test_module_imports_alone(module):
    """Import `module` with no project module loaded before it."""
    saved = {
        name: mod
        for name, mod in sys.modules.items()
        if name.split(".")[0] in ("hgxserve", "roles", "deploys")
    }
    for name in saved:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in ("hgxserve", "roles")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _readme_layers() -> list[tuple[str, list[str]]]:
    """The README's layers table: (layer, the packages it names), lowest first."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Layers: what may import what", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("|") or set(cells[0]) <= {"-"}:
            continue
        if cells[0].startswith("layer"):
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def test_the_readme_layers_table_is_the_tree():
    """README "Architecture": the layers, lowest first, each with the packages LAYERS gives it."""
    readme = _readme_layers()
    assert [name.split(":")[0] for name, _ in LAYERS] == [name for name, _ in readme]
    for (name, prefixes), (_, named) in zip(LAYERS, readme, strict=True):
        for prefix in prefixes:
            assert prefix in named, f"README layer {name!r} does not name {prefix}"


def test_the_architecture_section_follows_the_two_commands():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Architecture"
    for package in sorted(p.name for p in (REPO_ROOT / "hgxserve").iterdir() if p.is_dir()):
        if package in ("files", "schemas", "__pycache__"):
            continue
        assert f"`hgxserve/{package}/`" in text, f"README architecture lacks hgxserve/{package}/"
    assert sorted(p.name for p in (REPO_ROOT / "hgxserve").glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in (REPO_ROOT / "hgxserve").glob("*/cli.py")) == []
