"""An API key is one generated word: 32 identical characters, a short pattern repeated, or a
key file with a line break inside (two lines, read as one key) were accepted as long as they
had 32 characters. Refused wherever a key is read (the proxy, the gate, bench) and for an
`{env:}` key the controller pushes; no message says the key."""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path

import pytest
from pyinfra.api import DeployError

from hgxserve.base.apikeys import KeyFileError, key_problem, read_key_file
from hgxserve.deploy.keyfiles import check_env_keys
from hgxserve.topology import load_topology
from hgxserve.topology.model import SecretRef

GOOD = "3f9c1a7e5b2d48c0a6e1f9b7d3c5a2e8"  # openssl rand -hex 16

BAD = {
    "32 identical characters": ("k" * 32, "only 1 distinct characters"),
    "two characters": ("ab" * 20, "only 2 distinct characters"),
    "a pattern repeated": ("0123456789abcdef" * 2, "a shorter pattern repeated"),
    "an inner newline": (GOOD[:16] + "\n" + GOOD[16:] + "x", "not printable ASCII"),
    "an inner carriage return": (GOOD + "\r" + GOOD, "not printable ASCII"),
    "a space": (GOOD[:16] + " " + GOOD, "not printable ASCII"),
    "a tab": (GOOD + "\t" + GOOD, "not printable ASCII"),
    "non-ASCII": (GOOD + "é", "not printable ASCII"),
    "a NUL": (GOOD + "\0" + GOOD, "not printable ASCII"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_key_that_is_no_generated_word_is_refused(tmp_path: Path, case: str) -> None:
    key, why = BAD[case]
    assert why in (key_problem(key) or ""), case
    path = tmp_path / "api-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    with pytest.raises(KeyFileError) as err:
        read_key_file(str(path))
    assert str(err.value).startswith(f"{path}: the API key in it: ") and why in str(err.value)
    assert key.strip() not in str(err.value)


def test_generated_keys_pass(tmp_path: Path) -> None:
    for key in (
        GOOD,
        secrets.token_hex(32),
        secrets.token_urlsafe(32),
        "hgxserve-demo-api-key-0123456789",
    ):
        assert key_problem(key) is None, key
    path = tmp_path / "api-key"
    path.write_text("  " + GOOD + "\n\n")  # surrounding whitespace is no part of the key
    path.chmod(0o600)
    assert read_key_file(str(path)) == GOOD


def test_an_env_key_the_controller_pushes_is_checked_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = Path(__file__).resolve().parents[2]
    topo = load_topology(repo / "topologies/demo/demo-pd.yml")
    proxy = topo.proxy
    assert proxy is not None
    topo = replace(topo, proxy=replace(proxy, api_key=SecretRef("env", "PROXY_KEY")))
    monkeypatch.setenv("PROXY_KEY", "k" * 40)
    with pytest.raises(DeployError, match="PROXY_KEY: only 1 distinct characters") as err:
        check_env_keys(topo)
    assert "k" * 40 not in str(err.value)
    monkeypatch.setenv("PROXY_KEY", GOOD)
    check_env_keys(topo)
