"""The schema documents itself: every property has a description; objects are closed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hgxserve.topology.schema import topology_schema


def _walk(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


def test_every_property_has_a_description() -> None:
    missing = [
        f"{path}/properties/{name}"
        for path, node in _walk(topology_schema(), "#")
        if isinstance(node.get("properties"), dict)
        for name, prop in node["properties"].items()
        if not (isinstance(prop, dict) and prop.get("description"))
    ]
    assert missing == []


def test_every_object_with_properties_is_closed() -> None:
    open_objects = [
        path
        for path, node in _walk(topology_schema(), "#")
        if isinstance(node.get("properties"), dict)
        and node.get("additionalProperties") is not False
    ]
    assert open_objects == []
