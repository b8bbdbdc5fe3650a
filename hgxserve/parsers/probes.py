"""What the pyinfra facts (hgxserve.facts) make of their own commands' output: pure functions.

Each fact's `process()` calls one of these, so the value a fact reports can be tested, and
reused on a host, without pyinfra.

Example:
    >>> gpu_inventory_from_sections({"absent nvidia-smi": {"lines": [], "rc": None}})["status"]
    'absent'
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hgxserve.parsers import outputs
from hgxserve.parsers.sections import section_text, split_sections


def gpu_inventory_default() -> dict[str, Any]:
    """GpuInventory's value on a host without nvidia-smi."""
    return {"status": "absent", "count": 0, "driver_version": None, "gpus": [], "error": None}


def gpu_inventory_from_sections(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Build the GpuInventory value from split command output (see hgxserve.facts.gpu).

    Example:
        >>> gpu_inventory_from_sections({"absent nvidia-smi": {"lines": [], "rc": None}})["status"]
        'absent'
    """
    result = gpu_inventory_default()
    if "absent nvidia-smi" in sections:
        return result
    query = sections.get("query")
    if query and query["rc"] == 0:
        try:
            gpus = outputs.gpus_from_query("\n".join(query["lines"]))
        except ValueError:
            gpus = None
        if gpus is not None:
            drivers = {gpu.pop("driver_version") for gpu in gpus}
            result.update(
                status="ok",
                gpus=gpus,
                count=len(gpus),
                driver_version=sorted(d for d in drivers if d)[0] if any(drivers) else None,
            )
            return result
    table = sections.get("table")
    if table is None and query and any("NVIDIA-SMI" in line for line in query["lines"]):
        # An nvidia-smi that ignores --query-gpu and prints its table anyway.
        table = query
    if table and table["rc"] == 0:
        parsed = outputs.parse_smi_table("\n".join(table["lines"]))
        listed = sections.get("list") or {"lines": [], "rc": 1}
        uuids = {gpu["index"]: gpu for gpu in outputs.parse_smi_list("\n".join(listed["lines"]))}
        gpus = [
            {
                "index": gpu["index"],
                "name": uuids.get(gpu["index"], {}).get("name", gpu["name"]),
                "uuid": uuids.get(gpu["index"], {}).get("uuid"),
                "memory_total_mib": gpu["memory_total_mib"],
                "memory_used_mib": gpu["memory_used_mib"],
                "persistence_mode": gpu["persistence_mode"],
                "mig_mode": gpu["mig_mode"],
            }
            for gpu in parsed["gpus"]
        ]
        result.update(
            status="ok", gpus=gpus, count=len(gpus), driver_version=parsed["driver_version"]
        )
        return result
    failed = table or query or {"lines": []}
    result.update(status="error", error="\n".join(failed["lines"]).strip() or "no output")
    return result


def upstream_version(version: str | None) -> str | None:
    """The driver version inside a Debian package version (`570.158.01-0ubuntu1` -> `570.158.01`).

    Example:
        >>> upstream_version("1:570.158.01-1")
        '570.158.01'
    """
    if not version:
        return None
    match = re.search(r"(?:\d+:)?(\d+\.\d+(?:\.\d+)?)", version)
    return match.group(1) if match else None


def venv_state_from_lines(lines: list[str]) -> dict[str, Any]:
    """Parse VenvRuntimeState output (hgxserve.facts.runtime).

    >>> venv_state_from_lines(["##absent"])
    {'present': False}
    >>> venv_state_from_lines(['##json {"engine_version": "0.26.0"}', "##rc 0"])
    {'present': True, 'engine_version': '0.26.0'}
    """
    if any(line.strip() == "##absent" for line in lines):
        return {"present": False}
    for line in lines:
        if line.startswith("##json "):
            return {"present": True, **json.loads(line[len("##json ") :])}
    text = "\n".join(line for line in lines if not line.startswith("##rc"))
    return {"present": True, "error": text.strip()[-500:] or "the venv's python failed"}


def driver_cuda_default() -> dict[str, Any]:
    """DriverCuda's value on a host without nvidia-smi."""
    return {"status": "absent", "driver_version": None, "cuda_version": None}


def driver_cuda_from_lines(lines: list[str]) -> dict[str, Any]:
    """Parse DriverCuda output (nvidia-smi's first lines and its exit status)."""
    result = driver_cuda_default()
    if any(line.strip() == "##absent" for line in lines):
        return result
    text = "\n".join(line for line in lines if not line.startswith("##rc"))
    parsed = outputs.parse_smi_table(text) if "NVIDIA-SMI" in text else {}
    if parsed.get("driver_version"):
        result.update(
            status="ok",
            driver_version=parsed["driver_version"],
            cuda_version=parsed.get("cuda_version"),
        )
    else:
        result.update(status="error", error=text.strip()[-300:])
    return result


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_cache_state(lines: list[str]) -> dict[str, Any]:
    """Parse CacheState output (`##<root>/<key>/<marker>` then the marker's JSON, per key);
    unreadable markers count as absent (so they get restored).

    >>> parse_cache_state(["##/r/k1/.hgxserve-cache.json", '{"archive_sha256": "ab"}'])
    {'k1': {'archive_sha256': 'ab'}}
    """
    state: dict[str, Any] = {}
    for path, section in split_sections(lines).items():
        value = _json_object("\n".join(section["lines"]))
        if value is not None:
            state[os.path.basename(os.path.dirname(path))] = value
    return state


def parse_manifest_state(lines: list[str]) -> dict[str, Any]:
    """Parse ModelManifestState output; anything unreadable counts as not verified.

    >>> parse_manifest_state(["##marker", "sha256:ab", "##state", "{}", "##check", "ok"])
    {'marker': 'sha256:ab', 'source': None, 'manifest_digest': None, 'files': 0, 'check': 'ok'}
    """
    sections = split_sections(lines)
    marker = section_text(sections, "marker", "").strip() or None
    state = _json_object(section_text(sections, "state") or "{}") or {}
    return {
        "marker": marker,
        "source": state.get("source"),
        "manifest_digest": state.get("manifest_digest"),
        "files": len(state.get("files") or {}),
        "check": section_text(sections, "check", "").strip() or "absent",
    }
