"""pyinfra-style fixture tests for hgxserve roles and operations.

One JSON file per case under `tests/operations/<module>.<function>/`: keyword arguments, the
fake facts the host reports, and the exact commands expected. For an `@operation` the file
lists `commands` (and `noop_description` when nothing changes); for an `@deploy` it lists
`ops`, every operation in order with the commands it runs once `_if` conditions are evaluated
against the earlier operations' results, as pyinfra's execute phase does.

Facts are keyed by pyinfra fact name; facts that take arguments map `k=v, ...` (sorted by k)
to the value. `{"__type__": "module:Class", ...}` builds a typed argument (a model, sync
options) from its fields. A fact the code asks for that the case does not define fails the
test, so a case always states everything the operation looked at. Strings `datetime:ISO`
become datetimes.
"""

from __future__ import annotations

import importlib
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.api.deploy import add_deploy
from pyinfra.context import ctx_host, ctx_state

CASES = Path(__file__).parent / "operations"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # roles/ and deploys/ are top-level, not installed packages


def _value(raw: Any) -> Any:
    if isinstance(raw, str) and raw.startswith("datetime:"):
        return datetime.fromisoformat(raw[len("datetime:") :])
    if isinstance(raw, dict) and "__type__" in raw:
        # a typed argument: {"__type__": "module:Class", field: value, ...}
        module_name, _, name = raw["__type__"].partition(":")
        cls = getattr(importlib.import_module(module_name), name)
        return cls(**{key: _value(value) for key, value in raw.items() if key != "__type__"})
    if isinstance(raw, dict):
        return {key: _value(value) for key, value in raw.items()}
    if isinstance(raw, list):
        return [_value(value) for value in raw]
    return raw


def _fact_key(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{key}={kwargs[key]}" for key in sorted(kwargs))


class FakeFacts:
    """host.get_fact replacement answering from a case's `facts`; unknown facts fail loudly."""

    def __init__(self, facts: dict[str, Any]):
        self.facts = facts
        self.asked: set[str] = set()

    def __call__(self, cls: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs = {key: value for key, value in kwargs.items() if not key.startswith("_")}
        name = cls.name
        if name not in self.facts:
            raise KeyError(f"case does not define fact {name!r} (asked with {kwargs})")
        value = self.facts[name]
        if kwargs:
            key = _fact_key(kwargs)
            if not isinstance(value, dict) or key not in value:
                raise KeyError(f"case does not define fact {name!r} for {key!r}")
            value = value[key]
        self.asked.add(name)
        return _value(value)


def _command_json(command: Any) -> Any:
    if isinstance(command, str):
        command = StringCommand(command.strip())
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    if isinstance(command, FileUploadCommand):
        src = command.src
        if hasattr(src, "read"):
            src.seek(0)
            data = src.read()
            data = data.decode() if isinstance(data, bytes) else data
        else:
            data = Path(src).read_text()
        return ["upload", data, str(command.dest)]
    if isinstance(command, FunctionCommand):
        return ["call", command.function.__name__, command.kwargs]
    raise AssertionError(f"unexpected command {command!r}")


def _make_state(facts: dict[str, Any]):
    inventory = Inventory((["testhost"], {}))
    state = State(inventory=inventory, config=Config())
    host = inventory.get_host("testhost")
    fake = FakeFacts(facts)
    host.get_fact = fake  # type: ignore[method-assign]
    noops: list[str] = []
    host.noop = noops.append  # type: ignore[method-assign]
    return state, host, noops


def _is_operation(func: Any) -> bool:
    # @deploy wrappers also expose `_inner`; only the deploy's inner function has deploy_name.
    return not hasattr(getattr(func, "_inner", None), "deploy_name")


def _target(case_dir: str) -> Any:
    module_name, _, attr = case_dir.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def run_operation(func: Any, kwargs: dict[str, Any], facts: dict[str, Any]):
    state, host, noops = _make_state(facts)
    with ctx_state.use(state), ctx_host.use(host):
        commands = [_command_json(c) for c in func._inner(**kwargs)]
    return commands, noops


def run_deploy(func: Any, kwargs: dict[str, Any], facts: dict[str, Any]) -> list[list[Any]]:
    """Prepare the deploy with fake facts, then replay its operations like the execute phase."""
    state, host, _ = _make_state(facts)
    add_deploy(state, func, host=host, **kwargs)
    ops: list[list[Any]] = []
    state.is_executing = True  # evaluate `_if` against earlier operations' outcomes
    with ctx_state.use(state), ctx_host.use(host):
        for op_hash in host.op_hash_order:
            meta = state.get_op_meta(op_hash)
            data = state.get_op_data_for_host(host, op_hash)
            commands = list(data.command_generator())
            data.operation_meta.set_complete(
                success=True,
                commands=commands,
                combined_output=None,  # type: ignore[arg-type]
            )
            ops.append([sorted(meta.names)[0], [_command_json(c) for c in commands]])
    return ops


def _cases() -> list[Any]:
    found = []
    for case_dir in sorted(p for p in CASES.iterdir() if p.is_dir()):
        for case in sorted(case_dir.glob("*.json")):
            found.append(pytest.param(case_dir.name, case, id=f"{case_dir.name}/{case.stem}"))
    return found


@pytest.mark.parametrize(("target", "case_file"), _cases())
def test_operation_fixture(target: str, case_file: Path) -> None:
    case = json.loads(case_file.read_text())
    func = _target(target)
    kwargs = _value(case.get("kwargs", {}))
    facts = case.get("facts", {})
    with (
        patch("pyinfra.operations.util.files.get_timestamp", lambda: "a-timestamp"),
        patch("pyinfra.operations.files.get_timestamp", lambda: "a-timestamp"),
    ):
        if "exception" in case:
            with pytest.raises(Exception) as raised:
                if _is_operation(func):
                    run_operation(func, kwargs, facts)
                else:
                    run_deploy(func, kwargs, facts)
            assert type(raised.value).__name__ == case["exception"]["name"]
            assert str(raised.value) == case["exception"]["message"]
            return
        if _is_operation(func):
            commands, noops = run_operation(func, kwargs, facts)
            assert commands == case["commands"], json.dumps(commands, indent=2)
            if not commands:
                assert noops == [case["noop_description"]]
        else:
            ops = run_deploy(func, kwargs, facts)
            assert ops == case["ops"], json.dumps(ops, indent=2)
