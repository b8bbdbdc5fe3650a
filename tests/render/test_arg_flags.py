"""EngineArgs (ARG_FLAGS) is the one table of typed engine args: it covers every schema `args`
property with the schema's type, each row states whether the arg changes compilation and the
cache key follows that, each renderer writes every flag it lists for its engine, the extra-args
rule refuses them, and the code reads no arg the schema lacks. `VALUES` holds a sample value of
each arg that is not a boolean."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Literal, get_args, get_origin, get_type_hints, is_typeddict

import pytest
from conftest import ROOT, topology

from hgxserve.base.defaults import topology_schema
from hgxserve.caches.key import cache_key
from hgxserve.render.engines import engine_args, node_plan
from hgxserve.topology.engine_args import (
    ARG_FLAGS,
    COMPILE_ARGS,
    ArgFlag,
    EngineArgs,
    not_rendered,
)
from hgxserve.topology.rules.engine import TYPED_FLAGS

VALUES: dict[str, Any] = {
    "dtype": "bfloat16",
    "kv_cache_dtype": "fp8",
    "block_size": 64,
    "gpu_memory_utilization": 0.9,
    "max_model_len": 8192,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 8192,
    "max_cudagraph_capture_size": 64,
    "tokenizer_mode": "deepseek_v4",
    "tool_call_parser": "deepseek_v4",
    "reasoning_parser": "deepseek_v4",
    "chat_template": "/models/t.jinja",
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
    "attention_backend": "flashmla",
    "distributed_executor_backend": "mp",
    "eplb_config": {"num_redundant_experts": 32},
    "all2all_backend": "deepep_low_latency",
    "moe_runner_backend": "deep_gemm",
}


def _sample(key: str, switch: bool) -> Any:
    """A value of arg `key`: `switch` for a boolean, else its VALUES entry."""
    if topology_schema()["$defs"]["engineArgs"]["properties"][key].get("type") == "boolean":
        return switch
    assert key in VALUES, f"add a sample value of args.{key} to VALUES"
    return VALUES[key]


def _all_args(switch: bool) -> dict[str, Any]:
    return {k: _sample(k, switch) for k in topology_schema()["$defs"]["engineArgs"]["properties"]}


def test_every_schema_arg_is_in_the_table_and_nothing_else():
    props = set(topology_schema()["$defs"]["engineArgs"]["properties"])
    assert set(ARG_FLAGS) == props


@pytest.mark.parametrize(
    ("file", "name"), [("h20-v4flash-tp8.yml", None), ("seed003-sglang-tp8.yml", None)]
)
def test_each_renderer_writes_every_flag_of_its_engine(file, name):
    topo = topology(file)
    engine = topo.engines[name or next(iter(topo.engines))]
    words: set[str] = set()
    for switch in (True, False):
        changed = replace(engine, args=_all_args(switch))
        plan = node_plan(topo, changed, changed.head)
        words |= set(engine_args(topo, changed, plan))
        if switch:
            skipped = sorted(not_rendered(engine.engine))
            assert f"not applicable to {engine.engine}, not rendered: {', '.join(skipped)}" in (
                plan.notes
            )
    missing = [
        (key, f.flag(engine.engine))
        for key, f in ARG_FLAGS.items()
        if f.flag(engine.engine) is not None and f.flag(engine.engine) not in words
    ]
    assert missing == []
    # what the engine has no flag for is never written under the other engine's name
    other = {f.flag("sglang" if engine.engine == "vllm" else "vllm") for f in ARG_FLAGS.values()}
    own = {f.flag(engine.engine) for f in ARG_FLAGS.values()}
    assert not (words & (other - own - {None}))


def test_extra_args_rule_refuses_every_flag_of_the_table():
    for key, f in ARG_FLAGS.items():
        for name in f.flags:
            assert TYPED_FLAGS[name] == f"args.{key}", name
    assert TYPED_FLAGS["--no-async-scheduling"] == "args.async_scheduling"


def test_every_arg_states_whether_it_changes_compilation():
    # `compiles` has no default: a row without it does not build
    with pytest.raises(TypeError, match="compiles"):
        ArgFlag("--x", "--x")  # type: ignore[call-arg]
    assert all(isinstance(f.compiles, bool) for f in ARG_FLAGS.values())
    assert tuple(k for k, f in ARG_FLAGS.items() if f.compiles) == COMPILE_ARGS


_PY_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool}


def test_each_arg_type_and_render_form_agree_with_the_schema():
    props = topology_schema()["$defs"]["engineArgs"]["properties"]
    hints = get_type_hints(EngineArgs)
    for key, prop in props.items():
        hint, kind, form = hints[key], prop.get("type", "object"), ARG_FLAGS[key].form
        if "enum" in prop:
            assert get_origin(hint) is Literal and set(get_args(hint)) == set(prop["enum"]), key
        elif kind == "object":
            assert get_origin(hint) is dict or is_typeddict(hint), key
        else:
            assert hint is _PY_TYPES[kind], key
        expected = {"boolean": ("switch", "tristate"), "object": ("json",)}.get(kind, ("value",))
        assert form in expected, key


@pytest.mark.parametrize("key", list(ARG_FLAGS))
def test_the_cache_key_changes_with_exactly_the_args_that_compile(key):
    topo = topology("h20-v4flash-tp8.yml")
    engine = topo.engines[next(iter(topo.engines))]
    args = {k: v for k, v in engine.args.items() if k != key}
    without = replace(engine, args=args)
    for value in (_sample(key, True), _sample(key, False)):
        changed = replace(engine, args={**args, key: value})
        assert (cache_key(topo, changed) != cache_key(topo, without)) is ARG_FLAGS[key].compiles


def _literal_arg_reads(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, key) of each `<x>.args.get("key")`, `<x>.args["key"]` and `"key" in <x>.args`."""
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if node.func.attr == "get" and _is_args(target) and node.args:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_args(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_args(c) for c in node.comparators):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield node.lineno, key.value


def _is_args(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "args"


def test_code_reads_only_args_the_schema_has():
    # an arg the schema refuses is never set: reading it finds nothing, silently
    # (the cache bake read args.context_length, SGLang's flag name for max_model_len)
    props = set(topology_schema()["$defs"]["engineArgs"]["properties"])
    unknown = [
        f"{path.relative_to(ROOT)}:{line}: args.{key}"
        for path in sorted((ROOT / "hgxserve").rglob("*.py"))
        for line, key in _literal_arg_reads(ast.parse(path.read_text()))
        if key not in props
    ]
    assert unknown == []
