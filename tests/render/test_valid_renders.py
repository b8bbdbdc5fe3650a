"""Whatever `validate` accepts renders: every topology without errors, shipped or in a test
corpus, and variants generated from them (proxy kind, auth, routes, roles, binds, hosts), renders
for every host it uses and plans a release for every host; a multi-line description validates,
renders, and reaches no unit.

A variant `validate` refuses is fine (that is a rule doing its work); one it accepts and the
renderer refuses is the bug this file exists to catch.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hgxserve.release.plan import plan_release
from hgxserve.render import render_topology
from hgxserve.topology import check_topology
from hgxserve.topology.loader import load_document
from hgxserve.topology.model import Topology

REPO = Path(__file__).resolve().parents[2]
CORPUS_DIRS = [
    "topologies",
    "topologies/demo",
    "tests/topology/valid",
    "tests/topology/invalid",
    "tests/topology/fit",
    "tests/render/topologies",
    "tests/monitoring",
]
CORPUS = sorted(
    p for d in CORPUS_DIRS for p in (REPO / d).glob("*.yml") if "engines:" in p.read_text()
)
SHIPPED = sorted((REPO / "topologies").glob("*.yml")) + sorted(
    (REPO / "topologies" / "demo").glob("*.yml")
)
DEMOS = sorted((REPO / "topologies" / "demo").glob("*.yml"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def assert_renders(topo: Topology, what: str) -> None:
    """Render every host the topology uses and plan every host's release."""
    try:
        rendered = render_topology(topo)
        for host in topo.hosts:
            plan_release(topo, host)
    except Exception as exc:  # noqa: BLE001  (any failure is the finding)
        pytest.fail(f"{what} validates but does not render: {type(exc).__name__}: {exc}")
    assert set(rendered) == set(topo.hosts_in_use())


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def test_the_corpus_is_the_one_the_brief_names() -> None:
    names = {_rel(p) for p in CORPUS}
    assert {_rel(p) for p in SHIPPED} <= names
    assert any(n.startswith("tests/render/topologies/") for n in names)
    assert any(n.startswith("tests/topology/valid/") for n in names)


@pytest.mark.parametrize("path", CORPUS, ids=_rel)
def test_every_accepted_topology_renders(path: Path) -> None:
    result = check_topology(_rel(path))
    if result.errors or result.topology is None:
        return  # refused: nothing to render
    assert_renders(result.topology, _rel(path))


# -- generated variants ------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _absolute(data: dict[str, Any], base: Path) -> None:
    """Paths a topology resolves beside itself, made absolute for a copy written elsewhere."""
    model = data.get("model", {})
    if isinstance(model.get("config"), str) and not model["config"].startswith("/"):
        model["config"] = str((base / model["config"]).resolve())
    for spec in (data.get("files") or {}).values():
        source = spec.get("source", "")
        if not source.startswith(("/", "http://", "https://")):
            spec["source"] = str((base / source).resolve())


def _engines(data: dict[str, Any]) -> dict[str, Any]:
    return data.get("engines", {})


def _proxy_set(field: str, value: str) -> Mutation:
    """Set the proxy's `field` (where the topology has a proxy)."""

    def apply(data: dict[str, Any]) -> None:
        if "proxy" in data:
            data["proxy"][field] = value

    return apply


def _kind(kind: str) -> Mutation:
    return _proxy_set("kind", kind)


def _auth(level: int) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        if "proxy" not in data:
            return
        data["proxy"].pop("auth", None)
        if level >= 1:
            data["proxy"]["auth"] = {"api_key": {"env": "PROXY_API_KEY"}}
        if level >= 2:
            data["proxy"]["auth"]["engine_api_key"] = {"env": "ENGINE_API_KEY"}

    return apply


def _routing(mode: str) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        proxy = data.get("proxy")
        if proxy is None:
            return
        if mode == "routes-only":
            proxy.pop("combined", None)
            proxy.pop("pd_min_prompt_tokens", None)
        elif mode == "combined-only":
            proxy.pop("routes", None)
        elif mode == "all-combined":
            # every engine becomes a combined engine behind the proxy
            for engine in _engines(data).values():
                engine["role"] = "combined"
                engine.pop("kv", None)
            proxy.pop("routes", None)
            proxy.pop("pd_min_prompt_tokens", None)
            proxy["combined"] = list(_engines(data))

    return apply


def _flip_first_role(data: dict[str, Any]) -> None:
    for engine in _engines(data).values():
        if engine.get("role") == "combined":
            engine["role"] = "prefill"
            engine["kv"] = {"connector": "nixl"}
        else:
            engine["role"] = "combined"
            engine.pop("kv", None)
        return


def _bind_all(address: str) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        for engine in _engines(data).values():
            engine["bind"] = address

    return apply


def _proxy_on(index: int) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        hosts = list(data.get("hosts", {}))
        if "proxy" in data and index < len(hosts):
            data["proxy"]["host"] = hosts[index]

    return apply


def _gate_from(index: int) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        hosts = list(data.get("hosts", {}))
        if index < len(hosts):
            data.setdefault("gate", {})["from"] = hosts[index]

    return apply


def _limits(data: dict[str, Any]) -> None:
    if "proxy" in data:
        data["proxy"].update(max_body=100, timeout_s=0.001)


def _no_runtime(data: dict[str, Any]) -> None:
    data.get("defaults", {}).pop("runtime", None)
    for engine in _engines(data).values():
        engine.pop("runtime", None)


def _colliding_secret(data: dict[str, Any]) -> None:
    for engine in _engines(data).values():
        engine.setdefault("secret_env", {})["HF_TOKEN"] = {"env": "API_KEY"}
    _auth(1)(data)


def _file_secret(data: dict[str, Any]) -> None:
    for engine in _engines(data).values():
        engine.setdefault("secret_env", {})["HF_TOKEN"] = {"file": "/etc/hgxserve/hf-token\\"}


def _served_name_backslash(data: dict[str, Any]) -> None:
    data["model"]["served_name"] += "\\"


def _sglang_everywhere(data: dict[str, Any]) -> None:
    data.setdefault("defaults", {})["engine"] = "sglang"
    for engine in _engines(data).values():
        engine["engine"] = "sglang"


MULTI_LINE = "A lab topology.\nSecond line: ExecStartPre=/bin/false\n\tindented, 100% free text"


def _description(data: dict[str, Any]) -> None:
    data["description"] = MULTI_LINE


def _addresses(data: dict[str, Any]) -> None:
    for i, host in enumerate(data.get("hosts", {}).values()):
        host["address"] = f"gpu-{i}.lab.example" if i % 2 else f"fd00::{i + 11}"


SINGLES: dict[str, Mutation] = {
    "flip-role": _flip_first_role,
    "bind-loopback": _bind_all("127.0.0.1"),
    "bind-any": _bind_all("0.0.0.0"),
    "listen-loopback": _proxy_set("listen", "127.0.0.1:8000"),
    "listen-v6": _proxy_set("listen", "[::]:8000"),
    "proxy-on-0": _proxy_on(0),
    "proxy-on-1": _proxy_on(1),
    "proxy-on-2": _proxy_on(2),
    "gate-from-0": _gate_from(0),
    "gate-from-1": _gate_from(1),
    "limits": _limits,
    "no-runtime": _no_runtime,
    "colliding-secret": _colliding_secret,
    "file-secret-backslash": _file_secret,
    "served-name-backslash": _served_name_backslash,
    "sglang-everywhere": _sglang_everywhere,
    "multi-line-description": _description,
    "addresses": _addresses,
}
KINDS = ("hgxserve", "vllm-router", "sglang-router")
ROUTING = ("as-is", "routes-only", "combined-only", "all-combined")


def _variants() -> Iterator[tuple[str, list[Mutation]]]:
    for kind in KINDS:
        for auth in range(3):
            for routing in ROUTING:
                yield f"{kind}-auth{auth}-{routing}", [_kind(kind), _auth(auth), _routing(routing)]
    for name, mutation in SINGLES.items():
        yield name, [mutation]
        yield f"{name}+vllm-router-auth", [mutation, _kind("vllm-router"), _auth(1)]


BASES = sorted({*DEMOS, *SHIPPED, *sorted((REPO / "tests/render/topologies").glob("*.yml"))})


@pytest.mark.parametrize("base", BASES, ids=_rel)
def test_generated_variants_that_validate_render(base: Path, tmp_path: Path) -> None:
    data = load_document(base).data
    _absolute(data, base.parent)
    accepted = refused = 0
    for name, mutations in _variants():
        variant = copy.deepcopy(data)
        for mutate in mutations:
            mutate(variant)
        path = tmp_path / f"{base.stem}--{name}.yml"
        path.write_text(json.dumps(variant, indent=1))
        result = check_topology(path)
        if result.errors or result.topology is None:
            refused += 1
            continue
        accepted += 1
        assert_renders(result.topology, f"{_rel(base)} variant {name}")
    # the variants reach both sides: some validate (and render), some are refused
    assert accepted and refused, (accepted, refused)


def test_multi_line_description_validates_renders_and_reaches_no_unit(tmp_path: Path) -> None:
    base = REPO / "topologies" / "demo" / "demo-pd.yml"
    # the YAML as a user writes it: a block scalar in place of the one-line description
    text = "".join(
        line
        for line in base.read_text().splitlines(keepends=True)
        if not line.startswith("description:")
    )
    described = "description: |\n" + "".join(f"  {line}\n" for line in MULTI_LINE.splitlines())
    path = tmp_path / "described.yml"
    path.write_text(described + text)
    _absolute_files_in_place(path, base.parent)
    result = check_topology(path)
    assert [p.text() for p in result.errors] == []
    topo = result.topology
    assert topo is not None and topo.description == MULTI_LINE + "\n"
    for host_render in render_topology(topo).values():
        for file_path, (content, _) in host_render.tree.items():
            for line in MULTI_LINE.splitlines():
                assert line.strip() not in content, f"{line!r} reached {file_path}"


def _absolute_files_in_place(path: Path, base: Path) -> None:
    data = load_document(path).data
    before = json.dumps(data, sort_keys=True)
    _absolute(data, base)
    if json.dumps(data, sort_keys=True) != before:
        path.write_text(json.dumps(data, indent=1))


def test_control_characters_stay_refused_outside_free_text(tmp_path: Path) -> None:
    base = REPO / "topologies" / "demo" / "demo-pd.yml"
    data = load_document(base).data
    _absolute(data, base.parent)
    data["model"]["served_name"] = "m\nExecStartPre=/bin/sh"
    path = tmp_path / "newline.yml"
    path.write_text(json.dumps(data))
    problems = check_topology(path).errors
    assert [p.rule for p in problems] == ["control-character"]
    data["model"]["served_name"] = "m"
    data["description"] = "escape \x1b[31m is still refused"
    path.write_text(json.dumps(data))
    assert [p.rule for p in check_topology(path).errors] == ["control-character"]


def test_the_free_text_fields_are_the_schema_free_text_fields() -> None:
    from hgxserve.base.defaults import topology_schema

    schema = topology_schema()
    assert "Free text" in schema["properties"]["description"]["description"]
    assert "free text" in schema["properties"]["accept"]["additionalProperties"]["description"]
