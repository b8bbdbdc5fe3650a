"""JSON Schema validation of a topology document, every error with its position."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
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


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


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


def _problems_for(doc: Document, error: ValidationError) -> list[Problem]:
    path: JsonPath = tuple(error.absolute_path)
    value, keyword, schema = error.instance, error.validator, error.schema
    if keyword == "additionalProperties" and isinstance(value, dict):
        known = sorted(schema.get("properties", {}))
        out = []
        for extra in sorted(set(value) - set(known)):
            hint = difflib.get_close_matches(extra, known, n=1)
            msg = f"unknown property '{extra}'"
            msg += f"; did you mean '{hint[0]}'?" if hint else f"; allowed: {', '.join(known)}"
            out.append(doc.problem(path + (extra,), msg, key=True))
        return out
    if keyword == "required":
        missing = error.validator_value
        names = [m for m in missing if isinstance(value, dict) and m not in value]
        return [doc.problem(path, f"missing required property '{name}'") for name in names]
    if keyword in ("oneOf", "anyOf"):
        alts: list[dict[str, Any]] = error.validator_value
        if isinstance(value, dict):
            matching = [
                a
                for a in map(_resolve, alts)
                if a.get("required") and set(a["required"]) <= set(value)
            ]
            if len(matching) == 1:
                sub = _StrictValidator(matching[0], registry=_validator()._registry)  # noqa: SLF001
                found = []
                for suberr in sub.iter_errors(value):
                    suberr.path.extendleft(reversed(path))  # make paths absolute
                    found.extend(_problems_for(doc, suberr))
                if found:
                    return found
        else:
            # a scalar: explain the one alternative of its own type (maxLength, pattern, ...)
            kind = _kind(value)
            same = [a for a in map(_resolve, alts) if a.get("type") == kind]
            if len(same) == 1:
                sub = _StrictValidator(same[0], registry=_validator()._registry)  # noqa: SLF001
                found = []
                for suberr in sub.iter_errors(value):
                    suberr.path.extendleft(reversed(path))
                    found.extend(_problems_for(doc, suberr))
                if found:
                    return found
        return [doc.problem(path, f"must be {_alternatives(alts)}; got {_show(value)}")]
    if keyword == "type":
        want = error.validator_value
        want_text = " or ".join(want) if isinstance(want, list) else want
        if value is None:
            return [doc.problem(path, f"expected {want_text}, got an empty value")]
        return [doc.problem(path, f"expected {want_text}, got {_kind(value)} {_show(value)}")]
    if keyword == "enum":
        opts = ", ".join(str(o) for o in error.validator_value)
        return [doc.problem(path, f"must be one of: {opts}; got {_show(value)}")]
    if keyword == "pattern":
        desc = schema.get("description", "")
        return [doc.problem(path, f"invalid value {_show(value)}: {desc}".rstrip(": "))]
    if keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        sign = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
        return [doc.problem(path, f"must be {sign[keyword]} {error.validator_value}; got {value}")]
    if keyword == "maxProperties" and error.validator_value == 1:
        return [doc.problem(path, f"exactly one of {', '.join(value)} may be given")]
    if keyword == "minProperties":
        return [doc.problem(path, "must not be empty")]
    if keyword == "maxLength":
        return [doc.problem(path, f"longer than {error.validator_value} characters")]
    return [doc.problem(path, error.message)]


def schema_problems(doc: Document) -> list[Problem]:
    """Every schema error in the document (not only the first), with positions."""
    problems: list[Problem] = []
    for error in _validator().iter_errors(doc.data):
        problems.extend(_problems_for(doc, error))
    return problems
