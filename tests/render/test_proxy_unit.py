"""The proxy unit runs unprivileged; engine keys travel as credentials, never in plain sight."""

from __future__ import annotations

import json
from dataclasses import replace

from conftest import topology

from hgxserve.proxy.config import parse_proxy_config
from hgxserve.render import render_host, render_topology
from hgxserve.topology.model import SecretRef
from hgxserve.topology.rules import RULES

PROXY_UNIT = "/etc/systemd/system/hgxserve-proxy.service"


def keyed(name: str, **proxy_fields: object):
    topo = topology(name)
    assert topo.proxy is not None
    fields = {
        "api_key": SecretRef("env", "HGX_TEST_PROXY_KEY"),
        "engine_api_key": SecretRef("env", "HGX_TEST_ENGINE_KEY"),
        **proxy_fields,
    }
    return replace(topo, proxy=replace(topo.proxy, **fields))


def test_native_proxy_runs_as_a_dynamic_user_without_capabilities():
    topo = topology("demo/demo-pd.yml")
    unit = render_host(topo, "hgx-c").files[PROXY_UNIT].content
    lines = unit.splitlines()
    assert "DynamicUser=yes" in lines and "ProtectSystem=strict" in lines
    assert "CapabilityBoundingSet=" in lines and not any("Ambient" in x for x in lines)
    # the keys still arrive: systemd hands credentials to the dynamic user
    assert "LoadCredential=hgxserve-api-key" in lines
    assert "LoadCredential=hgxserve-engine-key" in lines


def test_port_below_1024_gets_only_the_bind_capability():
    topo = topology("demo/demo-pd.yml")
    assert topo.proxy is not None
    low = replace(topo, proxy=replace(topo.proxy, listen_port=443))
    lines = render_host(low, "hgx-c").files[PROXY_UNIT].content.splitlines()
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE" in lines
    assert "AmbientCapabilities=CAP_NET_BIND_SERVICE" in lines


def test_every_shipped_proxy_is_keyed_and_unprivileged():
    for name in (
        "demo/demo-baseline.yml",
        "demo/demo-pd.yml",
        "h20-v4flash-1p1d-2node.yml",
        "h20-v4flash-4p4d.yml",
        "h20-v4flash-tp8.yml",
        "h200-dsv32-2p1d.yml",
        "h200-dsv32-tp8.yml",
        "h200-dsv32-sglang-dp8.yml",
    ):
        topo = topology(name)
        assert topo.proxy is not None and topo.proxy.api_key is not None, name
        assert topo.proxy.api_key.kind == "credential", name
        rendered = render_topology(topo)
        proxy_host = rendered[topo.proxy.host]
        assert "DynamicUser=yes" in proxy_host.files[PROXY_UNIT].content, name
        config = json.loads(proxy_host.files["/etc/hgxserve/proxy.json"].content)
        assert config["auth"]["api_key_file"].startswith("/run/credentials/"), name
        sglang = any(e.engine == "sglang" for e in topo.engines.values())
        assert (topo.proxy.engine_api_key is None) is sglang, name
        if sglang:
            # no key on an SGLang command line: it listens on the proxy host's loopback instead
            assert "--host 127.0.0.1" in "\n".join(f.content for f in proxy_host.files.values()), (
                name
            )
            continue
        for host in rendered.values():
            for unit in host.units:
                if unit.engine is not None and unit.role != "watch":
                    assert "VLLM_API_KEY=hgxserve-engine-key --" in unit.content, unit.name
                    assert "LoadCredential=hgxserve-engine-key" in unit.content, unit.name


def test_engine_key_reaches_engines_and_proxy_as_one_credential(monkeypatch):
    monkeypatch.setenv("HGX_TEST_ENGINE_KEY", "engine-s3cr3t-do-not-leak")
    topo = keyed("demo/demo-pd.yml")
    rendered = render_topology(topo)
    blobs = [f.content for h in rendered.values() for f in h.files.values()]
    blobs += [" ".join(u.argv) for h in rendered.values() for u in h.units]
    assert not any("engine-s3cr3t" in b for b in blobs)
    proxy_host = rendered["hgx-c"]
    creds = {c.name: c for c in proxy_host.credentials}
    # the combined engine and the proxy share the file the release role writes on hgx-c
    assert creds["hgx-test-engine-key"].path == "/etc/hgxserve/credentials/hgx-test-engine-key"
    assert set(creds["hgx-test-engine-key"].units) == {
        "hgxserve-combined-0.service",
        "hgxserve-proxy.service",
    }
    config = json.loads(proxy_host.files["/etc/hgxserve/proxy.json"].content)
    assert config["auth"]["upstream_api_key_file"] == (
        "/run/credentials/hgxserve-proxy.service/hgx-test-engine-key"
    )
    assert parse_proxy_config(config).upstream_api_key_file is not None
    prefill = rendered["hgx-a"]
    assert [c.name for c in prefill.credentials] == ["hgx-test-engine-key"]
    unit = prefill.files["/etc/systemd/system/hgxserve-prefill-0.service"].content
    assert "exec-with-credentials VLLM_API_KEY=hgx-test-engine-key -- " in unit


def _found(rule_id: str, topo) -> list[str]:
    return [message for _, message in RULES[rule_id].check(topo)]


def test_engine_key_for_sglang_engines_is_accepted_and_rendered():
    # SGLang gets the key as --api-key in memory (tests/render/test_engine_privilege.py)
    topo = keyed("h200-dsv32-sglang-dp8.yml")
    assert _found("engine-api-key", topo) == []
    units = render_topology(topo)["h200-a"].units
    engine = next(u for u in units if u.engine == "sglang-0")
    assert "exec-with-credentials VLLM_API_KEY=hgx-test-engine-key -- " in engine.content


def test_engine_key_set_twice_is_refused():
    topo = keyed("demo/demo-baseline.yml")
    engine = topo.engines["combined-0"]
    twice = replace(engine, env={**engine.env, "VLLM_API_KEY": "x"})
    topo = replace(topo, engines={**topo.engines, "combined-0": twice})
    assert any("set it in one place" in m for m in _found("engine-api-key", topo))


def test_container_proxy_keeps_root_for_podman():
    topo = topology("sglang-pd-image.yml")
    assert topo.proxy is not None
    image = topo.engines["prefill-0"].runtime
    assert image is not None and image.is_container
    boxed = replace(topo, proxy=replace(topo.proxy, runtime=image))
    unit = render_host(boxed, topo.proxy.host).files[PROXY_UNIT].content
    assert unit.count("/usr/bin/podman run") == 1
    assert "DynamicUser" not in unit and "ProtectSystem=full" in unit
