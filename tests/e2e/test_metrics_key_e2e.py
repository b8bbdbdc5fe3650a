"""The proxy's /metrics key on the real test hosts: the demo P/D release with monitoring
(tests/monitoring/demo-pd-monitored.yml) and `proxy.auth.metrics_key: {env: ...}`, deployed
through deploys/site.py. The proxy wants the key on /metrics and has it only as a credential;
the real Prometheus on hgx-c scrapes it with the key file the monitoring stage wrote
(root:prometheus 0640); `hgxserve status` reads the proxy's rotation with it; a second
monitoring run changes nothing.

Uses test_monitoring's `lab` fixture (its package repository, S3 and clean-up).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_monitoring
from test_monitoring import PROXY, changes, prom, wait_for

from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MONITORED = REPO / "tests/monitoring/demo-pd-monitored.yml"
AUTH_LINE = "    engine_api_key: {credential: hgxserve-engine-key}"
KEY_VAR = "HGX_E2E_METRICS_KEY"
KEY = "e2e-metrics-key-7f3a9c0d5b1e4a62c8d09e17"
KEY_DIR = "/etc/prometheus/hgxserve-keys"
ENV = {KEY_VAR: KEY}
lab = test_monitoring.lab  # its module fixture: package repository, S3, clean-up


@pytest.fixture(scope="module")
def keyed(lab: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    text = MONITORED.read_text()
    assert AUTH_LINE in text
    path = tmp_path_factory.mktemp("metrics-key") / "demo-pd-metrics-key.yml"
    path.write_text(text.replace(AUTH_LINE, f"{AUTH_LINE}\n    metrics_key: {{env: {KEY_VAR}}}"))
    yield path
    lab.ssh("hgx-c", f"rm -rf {KEY_DIR} /etc/hgxserve/credentials/metrics-key")


def get(url: str, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        req = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (test host)
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_keyed_metrics_deploy_scrape_and_status(
    lab: testbed_hosts.Testbed,
    keyed: Path,
) -> None:
    first = lab.pyinfra(
        "deploys/site.py", "--data", f"topology={keyed}",
        "--data", "stages=runtime,weights,engines,monitoring",
        "--data", "health_timeout=75", "--data", "confirm_within=120",
        "--data", f"allow_env={KEY_VAR}", env=ENV,
    )  # fmt: skip
    assert changes(first) > 0
    # the proxy wants the key, and has it only as a credential
    assert get(f"{PROXY}/metrics") == (401, b"")
    assert get(f"{PROXY}/metrics", "wrong-key-0123456789")[0] == 401
    status, body = get(f"{PROXY}/metrics", KEY)
    assert status == 200 and b"hgxserve_proxy_instance_healthy" in body
    assert get(f"{PROXY}/health")[0] == 200
    unit = lab.ssh("hgx-c", "systemctl cat hgxserve-proxy.service", check=True).stdout
    assert "LoadCredential=metrics-key:/etc/hgxserve/credentials/metrics-key" in unit
    seen = lab.ssh(
        "hgx-c",
        "ps -eo args; journalctl -u hgxserve-proxy.service --no-pager; "
        "cat /etc/hgxserve/proxy.json",
    ).stdout
    assert KEY not in unit and KEY not in seen
    # Prometheus scrapes the proxy with the key the stage wrote for its user
    modes = lab.ssh("hgx-c", f"stat -c '%a %U %G' {KEY_DIR} {KEY_DIR}/demo-pd-proxy-metrics.key")
    assert modes.stdout.split("\n")[:2] == ["750 root prometheus", "640 root prometheus"]

    def proxy_up() -> list:
        targets = prom("/api/v1/targets")["activeTargets"]
        ours = [t for t in targets if t["labels"].get("job") == "hgxserve-proxy"]
        return ours if ours and all(t["health"] == "up" for t in ours) else []

    wait_for(proxy_up, "the proxy target up (scraped with its key)", timeout=90)
    # `hgxserve status` reads the proxy's rotation on its host with the key
    report = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "status", str(keyed), "--inventory",
         "inventory/testhosts.py", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    text = json.dumps(json.loads(report.stdout))
    assert "proxy /metrics" not in text and '"in_rotation": true' in text, text[:3000]
    again = lab.pyinfra(
        "deploys/monitoring.py", "--data", f"topology={keyed}", "--data", f"allow_env={KEY_VAR}",
        env=ENV,
    )  # fmt: skip
    assert changes(again) == 0, again.stdout[-3000:]
