"""The proxy's optional /metrics key (`auth.metrics_key_file`): a real `hgxserve proxy serve`
in front of a simulated engine on 127.0.0.1, scraped without, with a wrong and with the right
key; and what reads /metrics on the proxy's host (a drain, `hgxserve status`) sends it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from harness import http

from hgxserve.proxy.config import ProxyConfigError, parse_proxy_config, restart_needed
from hgxserve.proxy.scrape import metrics_headers

pytestmark = pytest.mark.timeout(90)

METRICS_KEY = "m-key-0123456789abcdef0123456789abcdef"
API_KEY = "client-key-0123456789abcdef0123456789"


def config(engine_url: str, **auth: str) -> dict:
    return {
        "protocol": "vllm-nixl",
        "served_model_name": "m",
        "combined": [engine_url],
        **({"auth": auth} if auth else {}),
    }


def key_file(tmp_path: Path, name: str, key: str) -> str:
    path = tmp_path / name
    path.write_text(key + "\n")
    path.chmod(0o600)  # key files must be private (hgxserve.base.apikeys)
    return str(path)


@pytest.fixture
def engine(engines):
    return engines("vllm", ["serve", "/models/m", "--served-model-name", "m"])


def test_metrics_wants_the_key_and_says_nothing_else(engine, proxy, tmp_path: Path) -> None:
    px = proxy(
        config(
            engine.url,
            metrics_key_file=key_file(tmp_path, "metrics-key", METRICS_KEY),
            api_key_file=key_file(tmp_path, "api-key", API_KEY),
        )
    )
    refused = [
        {},
        {"Authorization": "Bearer wrong-key-0123456789abc"},
        {"Authorization": f"Bearer {METRICS_KEY[:-1]}"},  # a prefix of the key
        {"Authorization": f"Bearer {API_KEY}"},  # the clients' key is not the /metrics key
        {"Authorization": f"Basic {METRICS_KEY}"},
        {"Authorization": "Bearer \xff\xfe"},
    ]
    for headers in refused:
        status, body, got = http("GET", px.url + "/metrics", headers=headers)
        assert (status, body) == (401, b""), headers
        assert got.get("WWW-Authenticate") == "Bearer"
    status, body, _ = http(
        "GET", px.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}
    )
    assert status == 200
    assert b"hgxserve_proxy_instance_healthy" in body
    # /health stays open (load balancers, the release's health wait); generation wants the
    # clients' key, not the /metrics key
    assert http("GET", px.url + "/health")[0] == 200
    ask = {"model": "m", "prompt": "hi", "max_tokens": 1}
    mine = {"Authorization": f"Bearer {METRICS_KEY}"}
    assert http("POST", px.url + "/v1/completions", ask, headers=mine)[0] == 401
    theirs = {"Authorization": f"Bearer {API_KEY}"}
    assert http("POST", px.url + "/v1/completions", ask, headers=theirs)[0] == 200
    log = px.log()
    assert METRICS_KEY not in log and "/metrics keyed" in log
    assert "Traceback" not in log


def test_without_a_key_metrics_stays_open(engine, proxy) -> None:
    px = proxy(config(engine.url))
    assert http("GET", px.url + "/metrics")[0] == 200
    assert "/metrics open" in px.log()


def test_host_readers_send_the_key_their_proxy_json_names(engine, proxy, tmp_path: Path) -> None:
    px = proxy(config(engine.url, metrics_key_file=key_file(tmp_path, "mk", METRICS_KEY)))
    headers = metrics_headers(px.config_path)
    assert headers == {"Authorization": f"Bearer {METRICS_KEY}"}
    req = urllib.request.Request(px.url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
    # an open proxy, or one whose configuration cannot be read: no header
    open_config = tmp_path / "open.json"
    open_config.write_text(json.dumps(config(engine.url)))
    assert metrics_headers(open_config) == {}
    assert metrics_headers(tmp_path / "missing.json") == {}


def test_config_takes_the_key_file_as_a_restart_only_path(tmp_path: Path) -> None:
    path = key_file(tmp_path, "mk", METRICS_KEY)
    keyed = parse_proxy_config(config("http://127.0.0.1:1", metrics_key_file=path))
    assert keyed.metrics_key_file == path
    plain = parse_proxy_config(config("http://127.0.0.1:1"))
    assert plain.metrics_key_file is None
    assert restart_needed(plain, keyed) == ["metrics_key_file"]
    with pytest.raises(ProxyConfigError, match=r"\$\.auth\.metrics_key_file: must be an absolute"):
        parse_proxy_config(config("http://127.0.0.1:1", metrics_key_file="relative/key"))
