"""Addresses as addresses, one proxy URL for every caller, and what `validate` now refuses
instead of `render` (the vllm-router cases the CLI used to accept and then fail on)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from hgxserve.bench.metrics import targets
from hgxserve.cli.topology import plan, validate
from hgxserve.monitoring.targets import JOB_PROXY, scrape_targets
from hgxserve.proxy.config import Limits, ProxyConfigError, parse_proxy_config
from hgxserve.release.plan import gate_spec
from hgxserve.topology import check_topology, load_topology
from hgxserve.topology.addresses import (
    address_problem,
    canonical,
    hostport_problem,
    url_problem,
)
from hgxserve.topology.ports import proxy_url, reach_address
from hgxserve.topology.rules.proxy import PROXY_MAX_BODY, PROXY_MIN_BODY, PROXY_MIN_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
DEMO_PD = "topologies/demo/demo-pd.yml"  # proxy on hgx-c, listen 0.0.0.0:8000


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize(
    "address",
    ["10.0.0.11", "fd00::11", "::1", "localhost", "gpu-01", "h20-a.lab.example", "H20-A.lab."],
)
def test_addresses_that_are_addresses(address: str) -> None:
    assert address_problem(address) is None


@pytest.mark.parametrize(
    "address",
    ["10.0.0.300", "1.2.3", "10.0.0.1.5", "host_1", "-gpu", "a..b", "fe80::1::2", "", "lab.123"],
)
def test_garbage_is_refused(address: str) -> None:
    assert address_problem(address) is not None


def test_one_spelling_per_address() -> None:
    assert canonical("FD00:0:0::11") == canonical("fd00::11")
    assert canonical("GPU-A.lab.") == canonical("gpu-a.lab")


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("https://s3.lab", False),
        ("http://[fd00::1]:9000/", False),
        ("https://s3.lab:65535", False),
        ("https://s3.lab:0", True),
        ("https://s3.lab:70000", True),
        ("https://s3.lab:x", True),
        ("https://10.0.0.300", True),
        ("https://", True),
    ],
)
def test_ports_inside_urls(text: str, bad: bool) -> None:
    assert (url_problem(text) is not None) == bad


@pytest.mark.parametrize(
    ("text", "bad"),
    [("mon-1:6789", False), ("[fd00::1]:6789", False), ("mon-1:0", True), ("mon-1:99999", True)],
)
def test_ports_inside_host_port(text: str, bad: bool) -> None:
    assert (hostport_problem(text) is not None) == bad


# -- proxy_url: the gate, the bench and Prometheus reach the proxy by one rule -------------------


def test_proxy_url_from_its_host_another_host_and_outside() -> None:
    topo = load_topology(DEMO_PD)
    assert proxy_url(topo, "hgx-c") == "http://127.0.0.1:8000"
    assert proxy_url(topo, "hgx-a") == "http://10.77.0.13:8000"
    assert proxy_url(topo, None) == "http://10.77.0.13:8000"


def test_proxy_url_for_specific_loopback_and_v6_listens() -> None:
    topo = load_topology(DEMO_PD)
    assert topo.proxy is not None
    specific = replace(topo, proxy=replace(topo.proxy, listen_host="192.168.7.13"))
    assert (
        proxy_url(specific, "hgx-c") == proxy_url(specific, "hgx-a") == "http://192.168.7.13:8000"
    )
    v6 = replace(topo, proxy=replace(topo.proxy, listen_host="::"))
    assert proxy_url(v6, "hgx-c") == "http://[::1]:8000"
    assert proxy_url(v6, "hgx-a") == "http://10.77.0.13:8000"
    assert reach_address(topo, "hgx-c", "127.0.0.1", "hgx-c") == "127.0.0.1"


def test_gate_bench_and_prometheus_use_the_same_proxy_url() -> None:
    topo = load_topology(DEMO_PD)
    spec = gate_spec(topo)
    assert spec is not None and spec["proxy_url"] == proxy_url(topo, "hgx-c")
    assert targets(topo, engine_urls=_engine_urls(topo)).proxy_url == proxy_url(topo, None)
    (proxy,) = [t for t in scrape_targets(topo) if t.job == JOB_PROXY]
    prom = topo.monitoring.prometheus_host if topo.monitoring else None
    assert "http://" + proxy.address == proxy_url(topo, prom)


def _engine_urls(topo) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {name: f"http://127.0.0.1:{e.port}" for name, e in topo.engines.items()}


# -- what validate refuses now, and plan with it -------------------------------------------------


@pytest.mark.parametrize("case", ["proxy-router-auth", "proxy-router-mix"])
def test_router_cases_fail_validate_and_plan_with_a_rule(case: str) -> None:
    path = f"tests/topology/invalid/{case}.yml"
    result = CliRunner().invoke(validate, [path, "--format", "json"])
    assert result.exit_code == 1
    assert case in result.output  # the rule id, in the JSON
    planned = CliRunner().invoke(plan, [path])
    assert planned.exit_code == 1
    assert "renderer failed" not in planned.output
    assert f"{path}:" in planned.output


def test_proxy_limits_are_the_proxy_config_checks() -> None:
    base = {"protocol": "vllm-nixl", "served_model_name": "m", "combined": ["http://a:1"]}
    for body, ok in ((PROXY_MIN_BODY, True), (PROXY_MIN_BODY - 1, False), (PROXY_MAX_BODY, True)):
        config = {**base, "limits": {"max_body_bytes": body}}
        if ok:
            parse_proxy_config(config)
        else:
            with pytest.raises(ProxyConfigError):
                parse_proxy_config(config)
    assert Limits().max_buffered_body_bytes == PROXY_MAX_BODY
    with pytest.raises(ProxyConfigError):
        parse_proxy_config({**base, "limits": {"read_timeout_s": PROXY_MIN_TIMEOUT_S / 2}})
    parse_proxy_config({**base, "limits": {"read_timeout_s": PROXY_MIN_TIMEOUT_S}})


def test_shipped_topologies_validate_clean_with_the_new_rules() -> None:
    shipped = sorted(REPO.glob("topologies/*.yml")) + sorted(REPO.glob("topologies/demo/*.yml"))
    for path in shipped:
        result = check_topology(path.relative_to(REPO))
        assert [p.text() for p in result.problems] == [], path
