"""JSON Schema validation of a topology document, every error with its position."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError

from hgxserve.base.defaults import topology_schema
from hgxserve.topology.loader import Document, control_character
from hgxserve.topology.problems import JsonPath, Problem


@cache
def _anchored(pattern: str) -> re.Pattern[str]:
    # JSON Schema patterns are ECMA-262, where `$` is the end of the input; Python's `$` also
    # matches before a final newline, so "/x\n" would pass "^/[a-z]+$". Use \A and \Z.
    if pattern.startswith("^"):
        pattern = r"\A" + pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.compile(pattern)


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    # a prefix pattern such as "^/" says nothing about the rest: a control character (a line
    # break in a unit) never matches a pattern here, whatever the pattern
    if not _anchored(pattern).search(instance) or control_character(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_StrictValidator = validators.extend(Draft202012Validator, {"pattern": _pattern})


@cache
def _validator() -> Draft202012Validator:
    return _StrictValidator(topology_schema())


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return topology_schema()["$defs"][ref.split("/")[-1]]
    return schema


# JSON types by Python type, bool before int (a bool is an int)
_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _kind(value: Any) -> str:
    return next((name for kind, name in _KINDS if isinstance(value, kind)), "null")


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _alternatives(schemas: list[dict[str, Any]]) -> str:
    parts = []
    for alt in schemas:
        alt = _resolve(alt)
        if "required" in alt:
            parts.append("{" + ", ".join(f"{k}: ..." for k in alt["required"]) + "}")
        elif "const" in alt:
            parts.append(json.dumps(alt["const"]))
        elif "type" in alt:
            parts.append(f"a{'n' if alt['type'][0] in 'aeiou' else ''} {alt['type']}")
    return " or ".join(parts)


def _unknown_properties(doc: Document, error: ValidationError, path: JsonPath) -> list[Problem]:
    value = error.instance
    if not isinstance(value, dict):
        return [doc.problem(path, error.message)]
    known = sorted(error.schema.get("properties", {}))
    out = []
    for extra in sorted(set(value) - set(known)):
        hint = difflib.get_close_matches(extra, known, n=1)
        msg = f"unknown property '{extra}'"
        msg += f"; did you mean '{hint[0]}'?" if hint else f"; allowed: {', '.join(known)}"
        out.append(doc.problem(path + (extra,), msg, key=True))
    return out


def _missing(doc: Document, error: ValidationError, path: JsonPath) -> list[Problem]:
    value = error.instance
    names = [m for m in error.validator_value if isinstance(value, dict) and m not in value]
    return [doc.problem(path, f"missing required property '{name}'") for name in names]


def _the_alternative(alts: list[dict[str, Any]], value: Any) -> dict[str, Any] | None:
    """The one alternative that explains `value` best: for an object the one whose required
    properties it has, for a scalar the one of its own type (maxLength, pattern, ...)."""
    if isinstance(value, dict):
        found = [
            a for a in map(_resolve, alts) if a.get("required") and set(a["required"]) <= set(value)
        ]
    else:
        found = [a for a in map(_resolve, alts) if a.get("type") == _kind(value)]
    return found[0] if len(found) == 1 else None


def _one_of(doc: Document, error: ValidationError, path: JsonPath) -> list[Problem]:
    alts: list[dict[str, Any]] = error.validator_value
    value = error.instance
    alt = _the_alternative(alts, value)
    if alt is not None:
        sub = _StrictValidator(alt, registry=_validator()._registry)  # noqa: SLF001
        found = []
        for suberr in sub.iter_errors(value):
            suberr.path.extendleft(reversed(path))  # make paths absolute
            found.extend(_problems_for(doc, suberr))
        if found:
            return found
    return [doc.problem(path, f"must be {_alternatives(alts)}; got {_show(value)}")]


def _wrong_type(doc: Document, error: ValidationError, path: JsonPath) -> list[Problem]:
    want = error.validator_value
    want_text = " or ".join(want) if isinstance(want, list) else want
    value = error.instance
    if value is None:
        return [doc.problem(path, f"expected {want_text}, got an empty value")]
    return [doc.problem(path, f"expected {want_text}, got {_kind(value)} {_show(value)}")]


def _message(error: ValidationError) -> str:
    """The message of a keyword that needs no more than the error itself."""
    keyword, value, wanted = error.validator, error.instance, error.validator_value
    if keyword == "enum":
        opts = ", ".join(str(o) for o in wanted)
        return f"must be one of: {opts}; got {_show(value)}"
    if keyword == "pattern":
        desc = error.schema.get("description", "")
        return f"invalid value {_show(value)}: {desc}".rstrip(": ")
    if keyword in _SIGNS:
        return f"must be {_SIGNS[keyword]} {wanted}; got {value}"
    if keyword == "maxProperties" and wanted == 1:
        return f"exactly one of {', '.join(value)} may be given"
    return _PLAIN.get(str(keyword), "").format(wanted) or error.message


_SIGNS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
_PLAIN = {"minProperties": "must not be empty", "maxLength": "longer than {} characters"}
_Explain = Callable[[Document, ValidationError, JsonPath], list[Problem]]
_EXPLAIN: dict[str, _Explain] = {
    "additionalProperties": _unknown_properties,
    "required": _missing,
    "oneOf": _one_of,
    "anyOf": _one_of,
    "type": _wrong_type,
}


def _problems_for(doc: Document, error: ValidationError) -> list[Problem]:
    path: JsonPath = tuple(error.absolute_path)
    explain = _EXPLAIN.get(str(error.validator))
    if explain is not None:
        return explain(doc, error, path)
    return [doc.problem(path, _message(error))]


def schema_problems(doc: Document) -> list[Problem]:
    """Every schema error in the document (not only the first), with positions."""
    problems: list[Problem] = []
    for error in _validator().iter_errors(doc.data):
        problems.extend(_problems_for(doc, error))
    return problems
