"""The deploys' trust checks (hgxserve.deploy.plans.trusted_topology) on fake hosts: an
inventory pin reaches the weights stage and the engine units as model.digest does; unpinned
trust_remote_code, a contradicting pin and a not-allowed `{env: VAR}` are refused before any
role runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, DeployError, Inventory, State
from pyinfra.api.host import Host

from hgxserve.deploy import plans

REPO = Path(__file__).resolve().parents[2]
DEMO = "topologies/demo/demo-pd.yml"
HOSTS = ["hgx-a", "hgx-b", "hgx-c"]
A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
FACTS: dict[str, Any] = {
    "ReleaseState": {"previous": "r1", "current": "r2", "gate_previous": True},
}


# the hosts' files by path (File fact); any other is a private key file of 40 bytes
FILES: dict[str, Any] = {}


def fake_fact(self: Host, fact: type, *args: Any, **kwargs: Any) -> Any:
    if fact.__name__ == "File":
        return FILES.get(kwargs["path"], {"mode": 600, "size": 40})
    return dict(FACTS[fact.__name__])


@pytest.fixture(autouse=True)
def _facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HGXSERVE_TOPOLOGY", raising=False)
    monkeypatch.setattr(Host, "get_fact", fake_fact)
    FILES.clear()
    monkeypatch.setattr(plans, "published_manifest_size", lambda *a: (None, "not read in tests"))


def run(data: dict[str, Any]) -> tuple[Inventory, dict[str, Host]]:
    """One pyinfra run over the demo's hosts whose inventory host data is `data` (with
    `--data topology=` its "topology", else the demo P/D topology)."""
    data = dict(data)
    topology = data.pop("topology", DEMO)
    inventory = Inventory((HOSTS, data), override_data={"topology": topology})
    state = State(inventory, Config())
    for host in inventory:
        state.activate_host(host)
    return inventory, {h.name: h for h in inventory}


def remote_code(tmp_path: Path, model_line: str = "") -> Path:
    """The demo topology with trust_remote_code on (and `model_line` added to its model)."""
    text = (REPO / DEMO).read_text()
    text = text.replace(
        "    max_num_seqs: 8\n", "    max_num_seqs: 8\n    trust_remote_code: true\n"
    )
    if model_line:
        text = text.replace("\nmodel:\n", f"\nmodel:\n  {model_line}\n", 1)
    path = tmp_path / "remote.yml"
    path.write_text(text)
    return path


def pins(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pins.yml"
    path.write_text(text)
    return str(path)


def unit_digests(inventory: Inventory, host: Host) -> set[str]:
    """The `--digest` of every engine unit's check-marker in `host`'s release."""
    release = plans.engines_plan(host, inventory).release
    found = set()
    for path, (content, _) in release.files.items():
        if path.endswith(".service") and "check-marker" in content:
            words = content.split("--digest ")
            found |= {w.split()[0] for w in words[1:]}
    return found


def test_an_inventory_pin_reaches_the_weights_stage_and_the_units(tmp_path: Path) -> None:
    inventory, hosts = run({"model_pins": pins(tmp_path, f"s3://models/tiny: {A}\n")})
    assert plans.weights_plan(hosts["hgx-a"]).digest == A
    assert unit_digests(inventory, hosts["hgx-a"]) == {A}
    inventory, hosts = run({})  # unpinned: no digest anywhere (the bucket's manifest decides)
    assert plans.weights_plan(hosts["hgx-a"]).digest is None
    assert unit_digests(inventory, hosts["hgx-a"]) == set()


def test_unpinned_remote_code_is_refused_before_any_stage(tmp_path: Path) -> None:
    topology = str(remote_code(tmp_path, "digest_from: inventory"))
    _, hosts = run({"topology": topology})
    for stage in (plans.preflight_plan, plans.provision_plan, plans.weights_plan):
        with pytest.raises(DeployError, match="trust_remote_code runs Python from the model tree"):
            stage(hosts["hgx-a"])
    _, hosts = run({"topology": topology, "model_pins": pins(tmp_path, f"tiny: {A}\n")})
    assert plans.weights_plan(hosts["hgx-a"]).digest == A
    pinned_here = str(remote_code(tmp_path, f"digest: {A}"))
    _, hosts = run({"topology": pinned_here})
    assert plans.weights_plan(hosts["hgx-a"]).digest == A
    _, hosts = run({"topology": topology, "weights_digest": B})  # this run's explicit pin
    assert plans.weights_plan(hosts["hgx-a"]).digest == B


def test_a_pin_that_contradicts_model_digest_is_refused(tmp_path: Path) -> None:
    topology = str(remote_code(tmp_path, f"digest: {A}"))
    _, hosts = run({"topology": topology, "model_pins": pins(tmp_path, f"tiny: {B}\n")})
    with pytest.raises(DeployError, match=r"model.digest sha256:a+ and the pins file .* differ"):
        plans.weights_plan(hosts["hgx-a"])
    _, hosts = run({"model_pins": pins(tmp_path, "tiny: sha256:1234\n")})
    with pytest.raises(DeployError, match="is not sha256:<64 hex digits>"):
        plans.weights_plan(hosts["hgx-a"])


def test_env_refs_only_for_names_the_inventory_allows(tmp_path: Path) -> None:
    text = (REPO / DEMO).read_text().replace("{credential: hgxserve-api-key}", "{env: SECRET_X}")
    topology = tmp_path / "env.yml"
    topology.write_text(text)
    inventory, hosts = run({"topology": str(topology), "allow_env": ["OTHER"]})
    for stage in (plans.provision_plan, plans.weights_plan):
        with pytest.raises(DeployError, match=r"\$\.proxy\.auth\.api_key: \{env: SECRET_X\}"):
            stage(hosts["hgx-a"])
    with pytest.raises(DeployError, match="allow_env: \\[SECRET_X\\]"):
        plans.engines_plan(hosts["hgx-a"], inventory)
    _, hosts = run({"topology": str(topology), "allow_env": "OTHER,SECRET_X"})
    assert plans.weights_plan(hosts["hgx-a"]).model.name == "tiny"


def test_an_unpinned_model_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, hosts = run({})
    with caplog.at_level("WARNING", logger="pyinfra"):
        plans.weights_plan(hosts["hgx-a"])
        plans.weights_plan(hosts["hgx-b"])
    warned = [r.message for r in caplog.records if "not pinned" in r.message]
    assert warned == [
        "weights of tiny: the bucket's own manifest — not pinned; whoever can write the bucket "
        "chooses them (pin them: model.digest, or the inventory's model_pins)"
    ]


# -- API keys -----------------------------------------------------------------------------------


def test_api_key_files_on_the_hosts_must_be_private_and_long_enough() -> None:
    inventory, hosts = run({})
    plans.engines_plan(hosts["hgx-a"], inventory)  # the demo's credential store files: fine
    FILES["/etc/credstore/hgxserve-engine-key"] = {"mode": 644, "size": 40}
    with pytest.raises(DeployError) as err:
        plans.engines_plan(hosts["hgx-a"], inventory)
    assert str(err.value) == (
        "hgx-a: $.proxy.auth.engine_api_key: API key file /etc/credstore/hgxserve-engine-key: "
        "mode 0644 lets group or others at it (chmod 600)"
    )
    FILES["/etc/credstore/hgxserve-engine-key"] = {"mode": 400, "size": 12}
    with pytest.raises(DeployError, match="12 bytes, shorter than the 32 a key needs"):
        plans.engines_plan(hosts["hgx-a"], inventory)
    FILES["/etc/credstore/hgxserve-engine-key"] = False  # a directory, a link
    with pytest.raises(DeployError, match="hgxserve-engine-key: not a regular file"):
        plans.engines_plan(hosts["hgx-a"], inventory)
    FILES["/etc/credstore/hgxserve-engine-key"] = None  # systemd looks in the next store
    FILES["/run/credstore/hgxserve-engine-key"] = {"mode": 600, "size": 40}
    plans.engines_plan(hosts["hgx-a"], inventory)


def test_a_file_api_key_must_be_on_the_host(tmp_path: Path) -> None:
    text = (REPO / DEMO).read_text().replace("{credential: hgxserve-api-key}", "{file: /k/api}")
    topology = tmp_path / "file.yml"
    topology.write_text(text)
    inventory, hosts = run({"topology": str(topology)})
    proxy_host = hosts["hgx-c"]  # demo-pd's proxy
    plans.engines_plan(proxy_host, inventory)
    FILES["/k/api"] = None
    with pytest.raises(DeployError, match=r"\$\.proxy\.auth\.api_key: API key file /k/api: not on"):
        plans.engines_plan(proxy_host, inventory)


def test_an_env_api_key_must_be_long_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (REPO / DEMO).read_text().replace("{credential: hgxserve-api-key}", "{env: PROXY_KEY}")
    topology = tmp_path / "env.yml"
    topology.write_text(text)
    inventory, hosts = run({"topology": str(topology), "allow_env": "PROXY_KEY"})
    monkeypatch.setenv("PROXY_KEY", "short-key")
    with pytest.raises(DeployError) as err:
        plans.engines_plan(hosts["hgx-c"], inventory)
    assert str(err.value) == (
        f"{topology}: $.proxy.auth.api_key: the API key in the controller's environment "
        "variable PROXY_KEY: 9 characters, shorter than the 32 required (generate one: "
        "openssl rand -hex 32)"
    )
    assert "short-key" not in str(err.value)
    full = "p" * 8 + "0123456789abcdef01234567"  # 32 characters
    monkeypatch.setenv("PROXY_KEY", full)
    plan = plans.engines_plan(hosts["hgx-c"], inventory)
    assert plan.secret_values == {"/etc/hgxserve/credentials/api-key": full}
