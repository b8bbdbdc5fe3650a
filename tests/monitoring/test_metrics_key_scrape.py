"""`proxy.auth.metrics_key`: the proxy loads it as a credential, the Prometheus scrape job for
the proxy sends it from a credentials_file the monitoring stage pushes (0640 for the
prometheus group), and the release gate reads /metrics with it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from hgxserve.monitoring.host_files import host_monitoring
from hgxserve.monitoring.render import render_tree
from hgxserve.proxy.config import parse_proxy_config
from hgxserve.release.plan import gate_spec, plan_release
from hgxserve.render import render_host
from hgxserve.topology import check_topology, load_topology
from hgxserve.topology.model import SecretRef

HERE = Path(__file__).resolve().parent
MONITORED = HERE / "demo-pd-monitored.yml"
KEY_VAR = "HGX_TEST_METRICS_KEY"
KEY_VALUE = "metrics-s3cr3t-do-not-leak"
AUTH_LINE = "    engine_api_key: {credential: hgxserve-engine-key}"
PROXY_KEY = "hgxserve-keys/demo-pd-proxy-metrics.key"


PROM_LINE = "  prometheus: {host: hgx-c, retention: 1d}"


def keyed_file(tmp_path: Path, ref: str, prometheus: bool = True) -> Path:
    """The monitored demo topology with `metrics_key: <ref>` under proxy.auth (and, without
    `prometheus`, no `monitoring:`: drop-in files for an existing Prometheus)."""
    text = MONITORED.read_text()
    assert AUTH_LINE in text and PROM_LINE in text
    text = text.replace(AUTH_LINE, f"{AUTH_LINE}\n    metrics_key: {ref}")
    if not prometheus:
        text = text[: text.index("\nmonitoring:") + 1]  # the last section
    path = tmp_path / "keyed.yml"
    path.write_text(text)
    return path


def keyed(tmp_path: Path, ref: str = f"{{env: {KEY_VAR}}}", prometheus: bool = True):
    return load_topology(str(keyed_file(tmp_path, ref, prometheus)))


def scrape_jobs(topo) -> dict[str, dict]:
    prom = YAML(typ="safe").load(render_tree(topo)["prometheus/prometheus.yml"])
    return {job["job_name"]: job for job in prom["scrape_configs"]}


def test_topology_takes_the_key_and_the_proxy_loads_it_as_a_credential(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_VAR, KEY_VALUE)
    topo = keyed(tmp_path)
    assert topo.proxy is not None and topo.proxy.metrics_key == SecretRef("env", KEY_VAR)
    host = render_host(topo, "hgx-c")
    config = json.loads(host.files["/etc/hgxserve/proxy.json"].content)
    assert config["auth"]["metrics_key_file"] == (
        "/run/credentials/hgxserve-proxy.service/metrics-key"
    )
    assert parse_proxy_config(config).metrics_key_file is not None
    unit = host.files["/etc/systemd/system/hgxserve-proxy.service"].content
    assert "LoadCredential=metrics-key:/etc/hgxserve/credentials/metrics-key" in unit
    creds = {c.name: c for c in host.credentials}
    assert creds["metrics-key"].path == "/etc/hgxserve/credentials/metrics-key"
    assert creds["metrics-key"].units == ("hgxserve-proxy.service",)
    # the release role pushes it (0600) like the API key; its value is nowhere in the render
    secrets = plan_release(topo, "hgx-c").secrets
    assert secrets["/etc/hgxserve/credentials/metrics-key"] == SecretRef("env", KEY_VAR)
    blobs = [f.content for f in host.files.values()] + [" ".join(u.argv) for u in host.units]
    assert not any(KEY_VALUE in blob for blob in blobs)
    assert not any(KEY_VALUE in text for text in render_tree(topo).values())


def test_the_proxy_scrape_job_sends_the_key_from_a_file(tmp_path: Path) -> None:
    jobs = scrape_jobs(keyed(tmp_path))
    proxy_job = jobs.pop("hgxserve-demo-pd-proxy")
    assert proxy_job["authorization"] == {"type": "Bearer", "credentials_file": PROXY_KEY}
    assert jobs and all("authorization" not in job for job in jobs.values())
    # without a key: no authorization anywhere (the default, /metrics open)
    plain = scrape_jobs(load_topology(str(MONITORED)))
    assert all("authorization" not in job for job in plain.values())


def test_prometheus_host_gets_the_key_file_and_no_other_host_does(tmp_path: Path) -> None:
    topo = keyed(tmp_path)
    c, a = host_monitoring(topo, "hgx-c"), host_monitoring(topo, "hgx-a")
    assert c is not None and a is not None
    assert c.prometheus_keys == {f"/etc/prometheus/{PROXY_KEY}": SecretRef("env", KEY_VAR)}
    assert a.prometheus_keys == {}
    # outside the drop-in directory, whose files the stage prunes to what it renders
    assert not any(path.startswith("/etc/prometheus/hgxserve/") for path in c.prometheus_keys)
    plain = host_monitoring(load_topology(str(MONITORED)), "hgx-c")
    assert plain is not None and plain.prometheus_keys == {}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (prometheus)")
def test_promtool_accepts_the_config_once_the_key_is_in_place(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for rel, text in render_tree(keyed(tmp_path)).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    prom = out / "prometheus"

    def check() -> subprocess.CompletedProcess[str]:
        cmd = ["promtool", "check", "config", "prometheus.yml"]
        return subprocess.run(cmd, cwd=prom, capture_output=True, text=True, check=False)

    missing = check()
    assert missing.returncode != 0 and PROXY_KEY.split("/")[-1] in missing.stdout + missing.stderr
    (prom / PROXY_KEY).parent.mkdir()
    (prom / PROXY_KEY).write_text("k-0123456789\n")
    ok = check()
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_key_the_controller_cannot_hand_prometheus_is_refused(tmp_path: Path) -> None:
    result = check_topology(keyed_file(tmp_path, "{credential: hgxserve-metrics-key}"))
    texts = [p.text() for p in result.errors]
    assert len(texts) == 1 and "$.proxy.auth.metrics_key" in texts[0], texts
    assert "metrics_key: {env: NAME}" in texts[0]
    assert result.errors[0].rule == "monitoring-host"
    assert check_topology(keyed_file(tmp_path, f"{{env: {KEY_VAR}}}")).errors == []
    # no Prometheus of the topology's own: an existing one gets the key from its operator
    assert keyed(tmp_path, "{credential: hgxserve-metrics-key}", prometheus=False) is not None


def test_the_gate_reads_metrics_with_the_key_where_the_proxy_loads_it(tmp_path: Path) -> None:
    spec = gate_spec(keyed(tmp_path))
    assert spec is not None
    assert spec["metrics_key_file"] == "/etc/hgxserve/credentials/metrics-key"
    spec = gate_spec(keyed(tmp_path, "{file: /etc/hgxserve/metrics.key}", prometheus=False))
    assert spec is not None and spec["metrics_key_file"] == "/etc/hgxserve/metrics.key"
    # a topology without the key keeps the gate (and so the release id) it always had
    plain = gate_spec(load_topology(str(MONITORED)))
    assert plain is not None and "metrics_key_file" not in plain
