"""Load YAML while keeping the position of every key and value.

`jsonschema.validate(yaml.safe_load(...))` loses positions and lets duplicate keys silently win;
here the node tree is composed first, duplicates are reported, and every JSON path maps back to
its line and column.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from hgxserve.topology.problems import JsonPath, Problem, Severity, TopologyError

_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
_INT_OTHER = re.compile(r"^[-+]?0(x[0-9a-fA-F_]+|o[0-7_]+|b[01_]+)$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$")
_MERGE_TAG = "tag:yaml.org,2002:merge"
# A topology is a few hundred values; these bounds stop hostile files (nested aliases, the YAML
# "billion laughs", or deep nesting) long before they cost memory or time.
MAX_FILE_BYTES = 1 << 20
MAX_VALUES = 20_000
MAX_DEPTH = 32


class _Refused(Exception):
    """A bound was crossed while building the document: one problem, nothing else is checked."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


# Line breaks and tabs a free-text value may hold (and nothing else of the control characters).
FREE_TEXT_CONTROLS = "\n\t"


def free_text(path: JsonPath) -> bool:
    """Whether the value at `path` is free text: the topology's `description` and the reasons
    under `accept`. People read them (validate, plan, the dashboard); the renderer never writes
    them into a unit or a command line, so they may span lines.

    >>> free_text(("description",)), free_text(("accept", "heads-per-rank"))
    (True, True)
    >>> free_text(("model", "path"))
    False
    """
    return path == ("description",) or (len(path) == 2 and path[0] == "accept")


def control_character(text: str, *, free: bool = False) -> str | None:
    """The first control character in `text` (newline, CR, tab, NUL, DEL, C1...), described.

    Topology strings end up in root-run systemd units and shell commands, where a newline
    starts a new directive: no key and no value but free text (`free`, where line breaks and
    tabs are fine) may hold one.

    >>> control_character("/models/x\\nExecStartPre=/bin/sh")
    'U+000A (line feed)'
    >>> control_character("/models/x") is None
    True
    >>> control_character("two\\nlines", free=True) is None
    True
    """
    for ch in text:
        if free and ch in FREE_TEXT_CONTROLS:
            continue
        if unicodedata.category(ch) == "Cc" or ch in "\u2028\u2029":
            name = unicodedata.name(ch, "") or _CONTROL_NAMES.get(ch, "control character")
            return f"U+{ord(ch):04X} ({name.lower()})"
    return None


# `<BUCKET>`, `<S3_ENDPOINT>`, `<CEPH_SECRET>`: the seeds' placeholders, copied but never filled in
_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>|\A<[^<>]+>\Z")


def placeholder(text: str) -> str | None:
    """A seed-style placeholder left in `text`, or None.

    >>> placeholder("https://<S3_ENDPOINT>")
    '<S3_ENDPOINT>'
    >>> placeholder('{"reasoning_start_str":"<think>"}') is None
    True
    """
    match = _PLACEHOLDER.search(text)
    return match.group(0) if match else None


_CONTROL_NAMES = {
    "\n": "line feed",
    "\r": "carriage return",
    "\t": "tab",
    "\0": "null",
    "\x1b": "escape",
    "\x7f": "delete",
}


@dataclass
class Document:
    """A parsed YAML document: plain data plus where each part of it was written."""

    file: str
    data: Any
    value_pos: dict[JsonPath, tuple[int, int]] = field(default_factory=dict)
    key_pos: dict[JsonPath, tuple[int, int]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # duplicate keys and the like

    def position(self, path: JsonPath, *, key: bool = False) -> tuple[int, int]:
        """Line and column (1-based) of the value at `path`, or of its key with `key=True`.

        Falls back to the nearest enclosing node that exists, so a missing property is reported
        on the object that lacks it.
        """
        table = self.key_pos if key else self.value_pos
        if path in table:
            return table[path]
        probe = path
        while probe:
            probe = probe[:-1]
            if probe in self.value_pos:
                return self.value_pos[probe]
        return self.value_pos.get((), (1, 1))

    def problem(
        self,
        path: JsonPath,
        message: str,
        *,
        rule: str = "schema",
        severity: Severity = "error",
        key: bool = False,
    ) -> Problem:
        line, col = self.position(path, key=key)
        return Problem(self.file, line, col, path, message, rule, severity)


_SPECIAL_FLOATS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}


def _yaml_int(value: str) -> int:
    text = value.replace("_", "")
    if _INT_OTHER.match(value) and not _INT.match(value):
        return int(text, 0)
    return int(text)


def _yaml_float(value: str) -> float:
    low = value.lower()
    if low in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[low]
    return float(value.replace("_", ""))


def _scalar(node: ScalarNode) -> Any:
    tag, value = str(node.tag or ""), node.value
    if tag.endswith(":null"):
        return None
    if tag.endswith(":bool"):
        return value.lower() in ("true", "yes", "on")
    if tag.endswith(":int"):
        return _yaml_int(value)
    if tag.endswith(":float"):
        return _yaml_float(value)
    return value


class _Builder:
    def __init__(self, doc: Document) -> None:
        self.doc = doc
        self.problems: list[Problem] = []
        self.values = 0
        self.open: set[int] = set()  # nodes being built: an alias to one of them is a cycle

    def _pos(self, node: Node) -> tuple[int, int]:
        return node.start_mark.line + 1, node.start_mark.column + 1

    def _refuse(self, node: Node, path: JsonPath, message: str) -> _Refused:
        line, col = self._pos(node)
        return _Refused(Problem(self.doc.file, line, col, path, message, "parse"))

    def build(self, node: Node, path: JsonPath) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise self._refuse(
                node,
                path,
                f"the document expands to more than {MAX_VALUES} values (aliases of aliases?); "
                "a topology needs a few hundred: write the values out or use fewer aliases",
            )
        if len(path) > MAX_DEPTH:
            raise self._refuse(node, path, f"nested deeper than {MAX_DEPTH} levels")
        if id(node) in self.open:
            raise self._refuse(node, path, "an alias refers to a value that contains it")
        self.doc.value_pos.setdefault(path, self._pos(node))
        if isinstance(node, MappingNode | SequenceNode):
            self.open.add(id(node))
            try:
                if isinstance(node, MappingNode):
                    return self._mapping(node, path)
                return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
            finally:
                self.open.discard(id(node))
        assert isinstance(node, ScalarNode)
        value = _scalar(node)
        if isinstance(value, str):
            self._check_text(node, path, value, "value", free=free_text(path))
            hole = placeholder(value)
            if hole is not None:
                self._report(
                    node, path, f"placeholder {hole} was never filled in; write the real value",
                    "placeholder",
                )  # fmt: skip
        return value

    def _report(self, node: Node, path: JsonPath, message: str, rule: str) -> None:
        line, col = self._pos(node)
        self.problems.append(Problem(self.doc.file, line, col, path, message, rule))

    def _check_text(
        self, node: Node, path: JsonPath, text: str, what: str, *, free: bool = False
    ) -> None:
        bad = control_character(text, free=free)
        if bad is not None:
            self._report(
                node,
                path,
                f"control character {bad} in a string {what}; topology strings end up in "
                "systemd units and shell commands: write it on one line without control "
                "characters",
                "control-character",
            )

    def _mapping(self, node: MappingNode, path: JsonPath) -> dict[str, Any]:
        out: dict[str, Any] = {}
        merged: list[MappingNode] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merged.extend(
                    value_node.value if isinstance(value_node, SequenceNode) else [value_node]
                )
                continue
            if not isinstance(key_node, ScalarNode):
                line, col = self._pos(key_node)
                self.problems.append(
                    Problem(self.doc.file, line, col, path, "keys must be plain strings", "parse")
                )
                continue
            key = str(_scalar(key_node))
            child = path + (key,)
            self._check_text(key_node, child, key, "key")
            if key in out:
                first = self.doc.key_pos[child]
                line, col = self._pos(key_node)
                self.problems.append(
                    Problem(
                        self.doc.file,
                        line,
                        col,
                        child,
                        f"duplicate key '{key}' (first defined at line {first[0]}); "
                        "remove one of them",
                        "duplicate-key",
                    )
                )
                continue
            self.doc.key_pos[child] = self._pos(key_node)
            empty = isinstance(value_node, ScalarNode) and value_node.value == ""
            if empty and not value_node.style:
                # `key:` with nothing after it: the parser marks the next token (often lines
                # later, or the end of the file); the mistake is at the key
                self.doc.value_pos.setdefault(child, self.doc.key_pos[child])
            out[key] = self.build(value_node, child)
        for source in merged:
            if not isinstance(source, MappingNode):
                continue
            for key, value in self._mapping(source, path).items():
                out.setdefault(key, value)
        return out


def load_document(path: str | Path) -> Document:
    """Parse one YAML file into a Document.

    Raises TopologyError(unreadable=True) when the file cannot be read or is not YAML. Duplicate
    keys are recorded in `Document.problems` (the first value is kept) so that the schema and
    the rules can still report everything else.

    >>> doc = load_document("topologies/h20-v4flash-tp8.yml")  # doctest: +SKIP
    >>> doc.position(("engines", "combined-0", "tp"))  # doctest: +SKIP
    (31, 9)
    """
    name = str(path)
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise TopologyError(
                [
                    Problem(
                        name,
                        1,
                        1,
                        (),
                        f"file is {size} bytes; a topology is at most {MAX_FILE_BYTES} bytes",
                        "read",
                    )
                ],
                unreadable=True,
            )
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TopologyError(
            [Problem(name, 1, 1, (), f"cannot read file: {reason}", "read")], unreadable=True
        ) from None
    # the safe composer skips round-trip comment gathering (~25% of the time); nodes keep marks
    yaml = YAML(typ="safe", pure=True)
    try:
        root = yaml.compose(text)
    except MarkedYAMLError as exc:
        line, col = _mistake_start(exc, text)
        msg = " ".join(x for x in (exc.context, exc.problem) if x) or "invalid YAML"
        raise TopologyError([Problem(name, line, col, (), msg, "parse")], unreadable=True) from None
    except YAMLError as exc:
        raise TopologyError(
            [Problem(name, 1, 1, (), f"invalid YAML: {exc}", "parse")], unreadable=True
        ) from None
    except RecursionError:
        raise TopologyError(
            [Problem(name, 1, 1, (), f"nested deeper than {MAX_DEPTH} levels", "parse")],
            unreadable=True,
        ) from None
    doc = Document(name, None)
    if root is None:
        raise TopologyError([Problem(name, 1, 1, (), "file is empty", "parse")], unreadable=True)
    builder = _Builder(doc)
    try:
        doc.data = builder.build(root, ())
    except _Refused as exc:
        raise TopologyError([exc.problem], unreadable=True) from None
    doc.problems = builder.problems
    return doc


def _mistake_start(exc: MarkedYAMLError, text: str) -> tuple[int, int]:
    """Where to report a YAML syntax error: where the scanner noticed it, unless that is the
    end of the file (an unclosed quote or bracket, a key without ':'), then where the unclosed
    construct starts."""
    problem, context = exc.problem_mark, exc.context_mark
    mark = problem or context
    if problem is not None and context is not None:
        end = len(text.rstrip())
        at_end = problem.index >= end or "end of stream" in (exc.problem or "")
        if at_end or "<stream end>" in (exc.problem or ""):
            mark = context
    return (mark.line + 1, mark.column + 1) if mark else (1, 1)
