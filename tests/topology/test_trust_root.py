"""The weights' trust root (model.digest, the inventory's pins file, or the bucket) and the
`{env: VAR}` allowance, as hgxserve.topology.trust computes them and `hgxserve plan` shows them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.cli.topology import plan
from hgxserve.topology import load_topology
from hgxserve.topology.trust import (
    TrustError,
    env_refs,
    env_refusals,
    inventory_trust,
    load_pins,
    pinned,
    source_key,
    trust_root,
    unpinned_refusal,
)

REPO = Path(__file__).resolve().parents[2]
DEMO = "topologies/demo/demo-pd.yml"  # tiny from s3://models/tiny/, credential refs only
REMOTE = "topologies/h200-dsv32-tp8.yml"  # trust_remote_code, digest_from: inventory
A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def _with_model_line(tmp_path: Path, source: str, line: str) -> Path:
    text = (REPO / source).read_text().replace("\nmodel:\n", f"\nmodel:\n  {line}\n", 1)
    out = tmp_path / Path(source).name
    out.write_text(text)
    return out


def _inventory(tmp_path: Path, data: dict[str, object]) -> Path:
    """A pyinfra inventory of the demo's and the H200 seed's hosts, each with `data`."""
    path = tmp_path / "inv.py"
    hosts = ["hgx-a", "hgx-b", "hgx-c", "h200-a"]
    path.write_text(f"lab = [{', '.join(repr((h, data)) for h in hosts)}]\n")
    return path


def test_pins_file_reads_a_mapping_of_sha256_digests(tmp_path: Path) -> None:
    good = tmp_path / "pins.yml"
    good.write_text(f"tiny: {A}\ns3://models/tiny: {A}\n")
    assert load_pins(str(good)) == {"tiny": A, "s3://models/tiny": A}
    for text, why in (
        ("tiny: sha256:abc\n", "is not sha256:<64 hex digits>"),
        (f"tiny: {A.upper()}\n", "is not sha256:<64 hex digits>"),
        ("- tiny\n", "not a mapping"),
        ("tiny: [\n", "not YAML"),
    ):
        good.write_text(text)
        with pytest.raises(TrustError, match=why):
            load_pins(str(good))
    with pytest.raises(TrustError, match="cannot read it"):
        load_pins(str(tmp_path / "missing.yml"))


def test_trust_root_topology_pin_or_bucket() -> None:
    topo = load_topology(DEMO)
    assert source_key(topo.model) == "s3://models/tiny"
    root = trust_root(topo.model)
    assert (root.kind, root.digest) == ("bucket", None)
    assert root.text() == "the bucket's own manifest — not pinned"
    by_name = trust_root(topo.model, {"tiny": A}, "pins.yml")
    assert (by_name.kind, by_name.digest, by_name.text()) == (
        "pins",
        A,
        f"pins file pins.yml ({A})",
    )
    by_source = trust_root(topo.model, {"s3://models/tiny": A, "other": B}, "pins.yml")
    assert by_source.digest == A
    with pytest.raises(TrustError, match="pin model tiny to different digests"):
        trust_root(topo.model, {"tiny": A, "s3://models/tiny": B}, "pins.yml")
    own = pinned(topo, by_name)
    assert own.model.digest == A  # what the weights stage and the units' check-marker enforce
    assert trust_root(own.model).text() == f"model.digest {A} (topology)"
    assert trust_root(own.model, {"tiny": A}, "pins.yml").kind == "topology"  # the same digest
    with pytest.raises(TrustError, match="model.digest .* and the pins file pins.yml .* differ"):
        trust_root(own.model, {"tiny": B}, "pins.yml")


def test_remote_code_without_a_pin_is_refused_and_with_one_accepted() -> None:
    topo = load_topology(REMOTE)
    message = unpinned_refusal(topo, trust_root(topo.model))
    assert message is not None
    assert message.startswith(f"{REMOTE}: $.defaults.args.trust_remote_code: trust_remote_code")
    assert "'DeepSeek-V3.2: sha256:...'" in message
    assert "'cephfs:/models/DeepSeek-V3.2: sha256:...'" in message
    assert unpinned_refusal(topo, trust_root(topo.model, {"DeepSeek-V3.2": A})) is None
    demo = load_topology(DEMO)  # no trust_remote_code: unpinned is allowed (plan warns)
    assert unpinned_refusal(demo, trust_root(demo.model)) is None


def test_env_refs_are_refused_unless_allowed(tmp_path: Path) -> None:
    text = (REPO / DEMO).read_text()
    text = text.replace("api_key: {credential: hgxserve-api-key}", "api_key: {env: PROXY_KEY}")
    text = text.replace(
        "\n  engine: vllm\n", "\n  engine: vllm\n  secret_env: {HF_TOKEN: {env: HF_TOKEN}}\n", 1
    )
    path = tmp_path / "env.yml"
    path.write_text(text)
    topo = load_topology(str(path))
    paths = {var: ".".join(map(str, where)) for where, var in env_refs(topo)}
    assert paths == {"HF_TOKEN": "defaults.secret_env.HF_TOKEN", "PROXY_KEY": "proxy.auth.api_key"}
    refused = env_refusals(topo, ["HF_TOKEN"])
    assert refused == [
        f"{path}: $.proxy.auth.api_key: {{env: PROXY_KEY}} would push the controller's "
        "environment variable PROXY_KEY to the hosts, and the inventory does not allow it; "
        "allow it with host data allow_env (e.g. allow_env: [PROXY_KEY] in the inventory, or "
        "--data allow_env=PROXY_KEY), or use {file: ...} / {credential: ...}"
    ]
    assert len(env_refusals(topo, ())) == 2
    assert env_refusals(topo, ("HF_TOKEN", "PROXY_KEY")) == []
    assert env_refusals(load_topology(DEMO), ()) == []  # credential refs push nothing


def test_inventory_trust_reads_the_hosts_data() -> None:
    assert inventory_trust([{}, {}]) == (None, ())
    data = {"model_pins": "p.yml", "allow_env": ["HF_TOKEN"]}
    assert inventory_trust([data, dict(data)]) == ("p.yml", ("HF_TOKEN",))
    assert inventory_trust([{"allow_env": "A, B"}]) == (None, ("A", "B"))
    with pytest.raises(TrustError, match="the hosts disagree on model_pins"):
        inventory_trust([data, {**data, "model_pins": "q.yml"}])


# -- hgxserve plan ----------------------------------------------------------------------------


def test_plan_shows_the_topology_pin_and_the_unpinned_bucket(tmp_path: Path) -> None:
    result = CliRunner().invoke(plan, [DEMO])
    assert result.exit_code == 0
    assert "weights trust root: the bucket's own manifest — not pinned" in result.stdout
    assert "warning: the weights are not pinned" in result.stderr
    path = _with_model_line(tmp_path, DEMO, f"digest: {A}")
    result = CliRunner().invoke(plan, [str(path)])
    assert f"weights trust root: model.digest {A} (topology)" in result.stdout
    assert "not pinned" not in result.output
    data = json.loads(CliRunner().invoke(plan, [str(path), "--format", "json"]).stdout)
    assert data["trust_root"] == {
        "kind": "topology",
        "digest": A,
        "where": "",
        "text": f"model.digest {A} (topology)",
    }


def test_plan_with_the_inventory_shows_its_pins_file(tmp_path: Path) -> None:
    pins = tmp_path / "pins.yml"
    pins.write_text(f"DeepSeek-V3.2: {A}\n")
    inventory = _inventory(tmp_path, {"model_pins": str(pins)})
    result = CliRunner().invoke(plan, [REMOTE, "--inventory", str(inventory)])
    assert result.exit_code == 0, result.output
    assert f"weights trust root: pins file {pins} ({A})" in result.stdout
    without = CliRunner().invoke(plan, [REMOTE])  # the pin is the inventory's: not known here
    assert "weights trust root: the inventory's pins file (model_pins; give --inventory" in (
        without.stdout
    )


def test_plan_with_the_inventory_refuses_what_a_deploy_refuses(tmp_path: Path) -> None:
    result = CliRunner().invoke(plan, [REMOTE, "--inventory", str(_inventory(tmp_path, {}))])
    assert result.exit_code == 1
    assert (
        "error: topologies/h200-dsv32-tp8.yml: $.defaults.args.trust_remote_code: "
        "trust_remote_code runs Python from the model tree, and model DeepSeek-V3.2 is not pinned"
    ) in result.stderr
    assert result.stdout == ""
    pins = tmp_path / "pins.yml"
    pins.write_text(f"DeepSeek-V3.2: {B}\n")
    pinned_topo = _with_model_line(tmp_path, REMOTE, f"digest: {A}")
    inventory = _inventory(tmp_path, {"model_pins": str(pins)})
    result = CliRunner().invoke(plan, [str(pinned_topo), "--inventory", str(inventory)])
    assert result.exit_code == 1
    assert "differ; the weights cannot match both" in result.stderr
    text = (REPO / DEMO).read_text().replace("{credential: hgxserve-api-key}", "{env: SECRET_X}")
    env_topo = tmp_path / "env.yml"
    env_topo.write_text(text)
    refused = CliRunner().invoke(plan, [str(env_topo), "--inventory", str(inventory)])
    assert refused.exit_code == 1
    assert "$.proxy.auth.api_key: {env: SECRET_X} would push" in refused.stderr
    allowed = _inventory(tmp_path, {"allow_env": ["SECRET_X"]})
    assert CliRunner().invoke(plan, [str(env_topo), "--inventory", str(allowed)]).exit_code == 0
