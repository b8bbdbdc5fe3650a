"""Load YAML while keeping the position of every key and value.

`jsonschema.validate(yaml.safe_load(...))` loses positions and lets duplicate keys silently win;
here the node tree is composed first, duplicates are reported, and every JSON path maps back to
its line and column.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from hgxserve.topology.problems import JsonPath, Problem, TopologyError

_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
_INT_OTHER = re.compile(r"^[-+]?0(x[0-9a-fA-F_]+|o[0-7_]+|b[01_]+)$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$")
_MERGE_TAG = "tag:yaml.org,2002:merge"


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
        severity: str = "error",
        key: bool = False,
    ) -> Problem:
        line, col = self.position(path, key=key)
        return Problem(self.file, line, col, path, message, rule, severity)


def _scalar(node: ScalarNode) -> Any:
    tag, value = str(node.tag or ""), node.value
    if tag.endswith(":null"):
        return None
    if tag.endswith(":bool"):
        return value.lower() in ("true", "yes", "on")
    if tag.endswith(":int"):
        text = value.replace("_", "")
        if _INT.match(value):
            return int(text)
        if _INT_OTHER.match(value):
            return int(text, 0)
        return int(text)
    if tag.endswith(":float"):
        low = value.lower()
        if low in (".inf", "+.inf"):
            return math.inf
        if low == "-.inf":
            return -math.inf
        if low == ".nan":
            return math.nan
        return float(value.replace("_", ""))
    return value


class _Builder:
    def __init__(self, doc: Document) -> None:
        self.doc = doc
        self.problems: list[Problem] = []

    def _pos(self, node: Node) -> tuple[int, int]:
        return node.start_mark.line + 1, node.start_mark.column + 1

    def build(self, node: Node, path: JsonPath) -> Any:
        self.doc.value_pos.setdefault(path, self._pos(node))
        if isinstance(node, MappingNode):
            return self._mapping(node, path)
        if isinstance(node, SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        assert isinstance(node, ScalarNode)
        return _scalar(node)

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
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        msg = " ".join(x for x in (exc.context, exc.problem) if x) or "invalid YAML"
        raise TopologyError([Problem(name, line, col, (), msg, "parse")], unreadable=True) from None
    except YAMLError as exc:
        raise TopologyError(
            [Problem(name, 1, 1, (), f"invalid YAML: {exc}", "parse")], unreadable=True
        ) from None
    doc = Document(name, None)
    if root is None:
        raise TopologyError([Problem(name, 1, 1, (), "file is empty", "parse")], unreadable=True)
    builder = _Builder(doc)
    doc.data = builder.build(root, ())
    doc.problems = builder.problems
    return doc
