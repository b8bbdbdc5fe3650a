"""The stage plans (hgxserve/deploy/plans.py) on fake hosts: what each stage hands its roles
from the topology and `--data`, and the errors an operator sees before anything changes."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import Config, DeployError, Inventory, State
from pyinfra.api.host import Host

from hgxserve.deploy import plans, switching
from hgxserve.release.coordination import RunPlan
from hgxserve.topology.cuda import DRIVER_VERSION

TOPOLOGY = "topologies/demo/demo-pd.yml"
HOSTS = ["hgx-a", "hgx-b", "hgx-c"]
FACTS: dict[str, Any] = {
    "HostPython": {"version": "3.11.2", "machine": "x86_64", "glibc": "2.36"},
    "ReleaseState": {"previous": "r1", "current": "r2", "gate_previous": True},
}


@pytest.fixture(autouse=True)
def _facts(monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    monkeypatch.delenv("HGXSERVE_TOPOLOGY", raising=False)
    monkeypatch.setattr(Host, "get_fact", lambda self, fact, *a, **k: dict(FACTS[fact.__name__]))
    # the demo's S3 is the test hosts': no published manifest is read from here
    monkeypatch.setattr(plans, "published_manifest_size", lambda *a: (None, "not read in tests"))


def run(data: dict[str, Any], names: list[str] = HOSTS) -> tuple[Inventory, dict[str, Host]]:
    """One pyinfra run over `names` with `--data` `data` (the demo P/D topology unless given)."""
    inventory = Inventory((names, {}), override_data={"topology": TOPOLOGY, **data})
    state = State(inventory, Config())
    for host in inventory:
        state.activate_host(host)
    return inventory, {h.name: h for h in inventory}


def test_a_host_outside_the_topology_is_refused_with_the_hosts_named():
    _, hosts = run({}, [*HOSTS, "stranger"])
    for plan in (
        plans.preflight_plan,
        plans.provision_plan,
        plans.runtime_plan,
        plans.weights_plan,
    ):
        with pytest.raises(DeployError) as err:
            plan(hosts["stranger"])
        assert str(err.value) == (
            "stranger: not a host of topology demo-pd (hosts: hgx-a, hgx-b, hgx-c)"
        )


def test_no_topology_and_an_invalid_one_are_clear_errors(tmp_path):
    inventory = Inventory((["hgx-a"], {}))
    State(inventory, Config())
    with pytest.raises(DeployError, match="no topology given: pass --data topology="):
        plans.weights_plan(inventory.get_host("hgx-a"))
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\n")
    _, hosts = run({"topology": str(bad)})
    with pytest.raises(DeployError, match=f"invalid topology {bad}"):
        plans.weights_plan(hosts["hgx-a"])


def test_provision_defaults_and_settings():
    _, hosts = run({})
    plan = plans.provision_plan(hosts["hgx-a"])
    assert (plan.driver_version, plan.driver_branch) == (DRIVER_VERSION, DRIVER_VERSION[:3])
    assert plan.fabric_manager and plan.require_nvswitch and plan.load_now and plan.remount_shm
    _, hosts = run({"load_now": "No", "remount_shm": 0, "fabric_manager": "never"})
    plan = plans.provision_plan(hosts["hgx-a"])
    assert not (plan.load_now or plan.remount_shm or plan.fabric_manager)
    _, hosts = run({"load_now": "nah"})
    with pytest.raises(DeployError, match=r"--data load_now='nah': not a boolean"):
        plans.provision_plan(hosts["hgx-a"])


def test_provision_sets_ibgda_where_deepep_spans_hosts():
    _, hosts = run({})
    assert plans.provision_plan(hosts["hgx-a"]).ibgda is False  # the demo has no DeepEP
    names = ["h200-a", "h200-e"]
    # trust_remote_code: deployed only with its weights pinned (here for this run)
    pin = "sha256:" + "1" * 64
    _, hosts = run({"topology": "topologies/h200-dsv32-2p1d.yml", "weights_digest": pin}, names)
    assert all(plans.provision_plan(hosts[n]).ibgda for n in names)


def test_runtime_wheels_come_from_the_weights_s3(tmp_path):
    wheel = "deep_ep-1.2.1-cp311-cp311-linux_x86_64.whl"
    text = (
        Path(TOPOLOGY)
        .read_text()
        .replace(
            "  runtime: {venv: /opt/vllm-sim}",
            f"  runtime:\n    venv: /opt/vllm-sim\n    wheels:\n"
            f"      - {{url: s3://wheels/{wheel}, sha256: {'a' * 64}}}",
        )
    )
    path = tmp_path / "t.yml"
    path.write_text(text)
    _, hosts = run({"topology": str(path)})
    plan = plans.runtime_plan(hosts["hgx-a"])
    assert plan.agent
    (venv,) = plan.venvs
    assert venv.spec.wheels[0].filename == "deep_ep-1.2.1-cp311-cp311-linux_x86_64.whl"
    assert venv.s3 is not None and venv.s3.endpoint


def test_site_stages_reach_the_preflight_of_the_same_run_only():
    _, hosts = run({"stages": "runtime,preflight,provision", "driver_version": "575.57.08"})
    host = hosts["hgx-a"]
    assert plans.preflight_plan(host).runtime_installs is False  # before site.py noted its stages
    assert plans.site_stages(host) == ("preflight", "provision", "runtime")  # in site order
    plan = plans.preflight_plan(host)
    assert plan.runtime_installs and plan.planned_driver == "575.57.08"
    _, again = run({"stages": "runtime,preflight,provision"})
    assert plans.preflight_plan(again["hgx-a"]).runtime_installs is False  # a new run
    with pytest.raises(DeployError, match="unknown bake; choose from preflight"):
        plans.site_stages(run({"stages": "weights,bake"})[1]["hgx-a"])


def test_runtime_index_settings():
    _, hosts = run({"runtime_find_links": "/w1,/w2", "runtime_no_index": True})
    plan = plans.runtime_plan(hosts["hgx-a"])
    assert plan.venvs and plan.venvs[0].index_url is None
    options = plan.venvs[0].wheelhouse.args[2]  # type: ignore[attr-defined]
    assert (options.find_links, options.no_index) == (("/w1", "/w2"), True)
    _, hosts = run({"runtime_source": "index"})
    with pytest.raises(DeployError, match="runtime_source=index needs runtime_index_url"):
        plans.runtime_plan(hosts["hgx-a"])
    _, hosts = run({"runtime_source": "mirror"})
    with pytest.raises(DeployError, match="runtime_source='mirror': use wheelhouse or index"):
        plans.runtime_plan(hosts["hgx-a"])


def test_weights_digest_and_agent():
    _, hosts = run({})
    plan = plans.weights_plan(hosts["hgx-a"])
    assert plan.agent == "/opt/hgxserve/bin/hgxserve"
    pinned = "sha256:" + "1" * 64
    _, hosts = run({"weights_digest": pinned, "agent": "/srv/agent"})
    plan = plans.weights_plan(hosts["hgx-a"])
    assert (plan.digest, plan.agent) == (pinned, "/srv/agent")


def test_rollback_plan_and_its_choice():
    inventory, hosts = run({"confirm_within": "120"})
    plan = plans.rollback_plan(hosts["hgx-a"], inventory)
    assert (plan.release_id, plan.confirm_within, plan.switch) == ("r1", 120, True)
    inventory, hosts = run({"to": "sideways"})
    with pytest.raises(DeployError, match="--data to='sideways': use previous or baseline"):
        plans.rollback_plan(hosts["hgx-a"], inventory)


def test_the_switch_is_planned_once_per_run_and_the_plan_cannot_change(monkeypatch):
    monkeypatch.setitem(FACTS, "File", {"mode": 600, "size": 40})  # the hosts' API key files
    made: list[tuple[Any, ...]] = []
    real = switching.run_plan

    def counted(*args: Any) -> RunPlan:
        made.append(args)
        return real(*args)

    monkeypatch.setattr(switching, "run_plan", counted)
    inventory, hosts = run({})
    coords = [plans.engines_plan(h, inventory).switching.coord for h in hosts.values()]
    assert len(made) == 1 and all(c is coords[0] for c in coords)  # one plan, every host's
    plan = coords[0].plan
    assert set(plan.switching) == set(HOSTS) and set(plan.rdma_roles) == {"hgx-a", "hgx-b"}
    assert plan.kv_policy == "fail" and plan.kv_needs["hgx-b"]
    with pytest.raises(FrozenInstanceError):
        plan.switching = {}  # type: ignore[misc]
    need = plan.kv_needs["hgx-b"]["hgxserve-decode-0.service"]
    mutations = [
        lambda: plan.switching.pop("hgx-a"),  # type: ignore[attr-defined]
        lambda: plan.targets.__setitem__("hgx-a", "r0"),  # type: ignore[index]
        lambda: plan.rdma_roles["hgx-a"].add("port_rcv_data"),  # type: ignore[attr-defined]
        lambda: plan.kv_endpoints.append(plan.kv_endpoints[0]),  # type: ignore[attr-defined]
        lambda: plan.kv_needs["hgx-b"].clear(),  # type: ignore[attr-defined]
        lambda: need.update(need_tokens=0),  # type: ignore[attr-defined]
    ]
    for mutate in mutations:
        with pytest.raises((TypeError, AttributeError)):
            mutate()
    # what the plan was built from is copied: changing it afterwards changes nothing
    rails = {"hgx-a": ["mlx5_6"]}
    built = RunPlan(kv_rails=rails)
    rails["hgx-a"].append("mlx5_7")
    assert built.kv_rails == {"hgx-a": ("mlx5_6",)}
    # the next run plans afresh
    inventory, hosts = run({})
    assert plans.engines_plan(hosts["hgx-a"], inventory).switching.coord is not coords[0]
    assert len(made) == 2


def test_a_misspelt_data_key_is_warned_about_once_per_run(caplog):
    _, hosts = run({"health_timout": 75, "lab_rack": "r1"})
    with caplog.at_level("WARNING", logger="pyinfra"):
        plans.weights_plan(hosts["hgx-a"])
        plans.weights_plan(hosts["hgx-b"])
    warned = [r.getMessage() for r in caplog.records if "no stage reads it" in r.getMessage()]
    assert warned == [
        "--data health_timout: no stage reads it; did you mean health_timeout? "
        "(hgxserve deploy-data)"
    ]


def test_a_role_takes_its_plan_or_the_plan_s_fields_never_both():
    model = plans.weights_plan(run({})[1]["hgx-a"]).model
    built = plans.plan_or_fields(None, plans.WeightsPlan, {"model": model})
    assert built == plans.WeightsPlan(model, None, "/opt/hgxserve/bin/hgxserve")
    assert plans.plan_or_fields(built, plans.WeightsPlan, {}) is built
    with pytest.raises(TypeError, match=r"give a plan or its fields, not both \(digest\)"):
        plans.plan_or_fields(built, plans.WeightsPlan, {"digest": "sha256:1"})
    with pytest.raises(TypeError):
        plans.plan_or_fields(None, plans.WeightsPlan, {"model": model, "modle": model})


def test_preflight_sizes_the_disk_check_from_the_published_manifest(monkeypatch):
    asked = []

    def published(url, endpoint, region, addressing, profile):
        asked.append((url, endpoint, addressing, profile))
        return 740 * 2**30, f"the published manifest {url}"

    monkeypatch.setattr(plans, "published_manifest_size", published)
    _, hosts = run({})
    expect = plans.preflight_plan(hosts["hgx-b"]).expect
    url = "s3://models/tiny/hgxserve-manifest.json"
    assert (expect.model_size_bytes, expect.model_size_from) == (
        740 * 2**30,
        f"the published manifest {url}",
    )
    # the demo's credentials are an env file on the hosts: the controller uses its own chain
    assert asked == [(url, "http://10.77.0.1:9000", "path", None)]
    assert plans.provision_plan(hosts["hgx-b"]).preflight.expect.model_size_bytes == 740 * 2**30


def test_an_index_runtime_needs_the_labs_hash_lock(tmp_path: Path) -> None:
    index = {"runtime_source": "index", "runtime_index_url": "http://10.0.0.5/simple"}
    _, hosts = run(index)
    with pytest.raises(DeployError, match="needs runtime_index_lock=PATH"):
        plans.runtime_plan(hosts["hgx-a"])
    _, hosts = run({**index, "runtime_index_unpinned": True})  # the explicit opt-out
    assert all(v.index_lock is None for v in plans.runtime_plan(hosts["hgx-a"]).venvs)
    short = tmp_path / "short.lock"
    short.write_text(f"six==1.17.0 --hash=sha256:{'1' * 64}\n")
    _, hosts = run({**index, "runtime_index_lock": str(short)})
    with pytest.raises(DeployError, match=r"short.lock: the venv \S+ needs vllm==\S+ \(not in"):
        plans.runtime_plan(hosts["hgx-a"])
    plan = plans.runtime_plan(run({"runtime_find_links": "/w1"})[1]["hgx-a"])
    spec = plan.venvs[0].spec
    full = tmp_path / "full.lock"
    full.write_text(
        "".join(f"{r} --hash=sha256:{'2' * 64}\n" for r in spec.requirements)
        + f"six==1.17.0 --hash=sha256:{'1' * 64}\n"
    )
    _, hosts = run({**index, "runtime_index_lock": str(full)})
    venv = plans.runtime_plan(hosts["hgx-a"]).venvs[0]
    assert venv.index_url == index["runtime_index_url"]
    assert venv.index_lock is not None and dict(venv.index_lock.pins)["six"] == "1.17.0"
    bad = tmp_path / "bad.lock"
    bad.write_text(f"--extra-index-url http://evil/simple\n{full.read_text()}")
    _, hosts = run({**index, "runtime_index_lock": str(bad)})
    with pytest.raises(DeployError, match="runtime_index_lock: .*bad.lock:1:"):
        plans.runtime_plan(hosts["hgx-a"])
