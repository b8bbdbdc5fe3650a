"""A proxy open to everyone does not pass `validate --strict`: listening beyond loopback it
needs proxy.auth.api_key (the host firewall never filters the proxy's port), or an `accept:`
that says why (rule exposed-listener)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from hgxserve.cli.topology import validate
from hgxserve.topology import check_topology

REPO = Path(__file__).resolve().parents[2]
KEY = {"api_key": {"credential": "hgxserve-api-key"}}


def _topology(proxy: dict[str, Any], accept: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": "open-proxy",
        "hosts": {"h-a": {"address": "10.0.0.11", "gpu": "H200"}},
        "model": {
            "name": "m",
            "served_name": "m",
            "path": "/models/m",
            "source": {"local": {"path": "/models/m"}},
        },
        "engines": {
            "combined-0": {
                "role": "combined",
                "engine": "vllm",
                "runtime": {"venv": "/opt/vllm"},
                "place": {"h-a": [0, 1]},
                "tp": 2,
                "port": 8100,
                "args": {"max_num_seqs": 8},
            }
        },
        "proxy": {"host": "h-a", "combined": ["combined-0"], **proxy},
        **({"accept": accept} if accept else {}),
    }


def _exposed(tmp_path: Path, doc: dict[str, Any]) -> list[str]:
    path = tmp_path / "t.yml"
    path.write_text(yaml.safe_dump(doc))
    return [p.message for p in check_topology(str(path)).problems if p.rule == "exposed-listener"]


@pytest.mark.parametrize(
    "listen", [None, "0.0.0.0:8000", "[::]:8000", "10.0.0.11:8000", "0.0.0.0:9000"]
)
def test_a_keyless_proxy_beyond_loopback_is_exposed(tmp_path: Path, listen: str | None) -> None:
    doc = _topology({} if listen is None else {"listen": listen})
    (message,) = _exposed(tmp_path, doc)
    assert "no proxy.auth.api_key" in message
    path = tmp_path / "t.yml"
    result = CliRunner().invoke(validate, ["--strict", str(path)])
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize("listen", ["127.0.0.1:8000", "127.0.0.2:8000", "[::1]:8000"])
def test_a_proxy_on_loopback_needs_no_key(tmp_path: Path, listen: str) -> None:
    assert _exposed(tmp_path, _topology({"listen": listen})) == []


def test_a_keyed_proxy_or_a_stated_accept_passes_strict(tmp_path: Path) -> None:
    assert _exposed(tmp_path, _topology({"auth": KEY})) == []
    accepted = _topology({}, {"exposed-listener": "a lab network nobody else reaches"})
    assert _exposed(tmp_path, accepted) == []


def test_a_router_takes_no_key_and_is_exposed(tmp_path: Path) -> None:
    doc = _topology({"kind": "vllm-router"})
    doc["engines"]["combined-0"]["role"] = "combined"
    assert len(_exposed(tmp_path, doc)) == 1


def test_every_shipped_topology_with_a_proxy_beyond_loopback_has_a_key_or_says_why() -> None:
    for path in sorted((REPO / "topologies").rglob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        proxy = doc.get("proxy")
        if not proxy or str(proxy.get("listen", "0.0.0.0")).startswith(("127.", "[::1]")):
            continue
        keyed = bool((proxy.get("auth") or {}).get("api_key"))
        accepted = "exposed-listener" in (doc.get("accept") or {})
        assert keyed or accepted, path.name
        # a real lab's topology (not the test lab's demo) gets a key, not an accept
        assert keyed or path.parent.name == "demo", path.name
