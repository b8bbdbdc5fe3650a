"""`hgxserve monitoring render`: targets and labels from the topology, deterministic output."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ruamel.yaml import YAML

from hgxserve.monitoring.dashboard import dashboard, queries
from hgxserve.monitoring.render import render_tree
from hgxserve.monitoring.rules import alert_sla
from hgxserve.monitoring.targets import scrape_targets, unreachable_engines
from hgxserve.topology import load_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MONITORED = str(HERE / "demo-pd-monitored.yml")
HGXSERVE = str(REPO / ".venv/bin/hgxserve")


def test_targets_carry_the_topology_labels() -> None:
    topo = load_topology(MONITORED)
    by_job: dict[str, list] = {}
    for t in scrape_targets(topo):
        by_job.setdefault(t.job, []).append(t)
    release = topo.digest[:12]
    (proxy,) = by_job["hgxserve-proxy"]
    # Prometheus runs on hgx-c, the proxy's host: it reaches the proxy over loopback
    assert proxy.address == "127.0.0.1:8000"
    assert proxy.labels == {
        "topology": "demo-pd",
        "release": release,
        "host": "hgx-c",
        "role": "proxy",
    }
    engines = {t.labels["engine"]: t for t in by_job["hgxserve-engine"]}
    assert engines["prefill-0"].address == "10.77.0.11:8100"
    assert engines["prefill-0"].labels == {
        "topology": "demo-pd",
        "release": release,
        "host": "hgx-a",
        "engine": "prefill-0",
        "role": "prefill",
        "backend": "vllm",
        "gpus": "0,1,2,3",
    }
    assert engines["decode-0"].address == "10.77.0.12:8200"
    # combined-0 binds loopback beside the proxy on hgx-c, where Prometheus runs too
    assert engines["combined-0"].address == "127.0.0.1:8300"
    assert engines["combined-0"].labels["gpus"] == "0,1"
    assert [t.address for t in by_job["hgxserve-node"]] == [
        "10.77.0.11:9100",
        "10.77.0.12:9100",
        "127.0.0.1:9100",
    ]
    assert [t.labels["host"] for t in by_job["hgxserve-dcgm"]] == ["hgx-a", "hgx-b", "hgx-c"]
    assert unreachable_engines(topo) == []


def test_without_a_prometheus_host_loopback_engines_are_named() -> None:
    topo = load_topology(str(REPO / "topologies/demo/demo-pd.yml"))
    assert unreachable_engines(topo) == ["combined-0"]
    proxy = [t for t in scrape_targets(topo) if t.job == "hgxserve-proxy"][0]
    assert proxy.address == "10.77.0.13:8000"


def test_monitoring_is_not_part_of_the_topology_digest() -> None:
    plain = load_topology(str(REPO / "topologies/demo/demo-pd.yml"))
    monitored = load_topology(MONITORED)
    assert plain.digest == monitored.digest
    assert monitored.monitoring is not None and plain.monitoring is None


def test_sla_comes_from_monitoring_else_the_strictest_bench_scenario() -> None:
    assert alert_sla(load_topology(MONITORED)).ttft_s == 3
    bench = load_topology(str(REPO / "topologies/h200-dsv32-2p1d.yml"))
    raw = bench.raw.get("bench")
    sla = alert_sla(bench)
    if raw:
        ttfts = [s["sla"]["ttft_s"] for s in raw["scenarios"] if "ttft_s" in s.get("sla", {})]
        assert sla.ttft_s == (min(ttfts) if ttfts else None)
    else:
        assert sla.ttft_s is None


def test_rules_use_the_engines_real_metric_names() -> None:
    text = render_tree(load_topology(MONITORED))["prometheus/hgxserve/rules/demo-pd.rules.yml"]
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_xfer_time_seconds_count",
        "hgxserve_proxy_requests_total",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_GPU_UTIL",
    ):
        assert name in text, name
    assert "sglang:" not in text  # no SGLang engine in this topology
    sgl = render_tree(load_topology(str(REPO / "topologies/h20-v4flash-sglang-1p1d.yml")))
    rules = next(v for k, v in sgl.items() if k.endswith(".rules.yml"))
    for name in (
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:token_usage",
        "sglang:num_queue_reqs",
        "sglang:num_transfer_failed_reqs_total",
    ):
        assert name in rules, name


def test_dashboard_is_provisioning_ready_and_shows_the_seeds_views() -> None:
    board = dashboard(load_topology(MONITORED))
    titles = [p["title"] for p in board["panels"]]
    for title in (
        "Output tokens/s per role",
        "Prefill tok/s per GPU",
        "TTFT P50 / P90 / P99",
        "TPOT P50 / P90 / P99",
        "KV transfers/s",
        "GPU utilisation",
        "GPU memory used",
        "GPU power",
    ):
        assert title in titles
    assert board["uid"] == "hgxserve-demo-pd"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"] if "targets" in p)
    ids = [p["id"] for p in board["panels"]]
    assert ids == sorted(set(ids))
    assert all('topology="$topology"' in q for q in queries(board))
    # a topology without P/D gets no KV panels
    tp8 = dashboard(load_topology(str(REPO / "topologies/h200-dsv32-tp8.yml")))
    assert not any("KV transfer" in p["title"] for p in tp8["panels"])


def test_render_is_deterministic_and_the_cli_writes_it(tmp_path: Path) -> None:
    first = render_tree(load_topology(MONITORED))
    assert first == render_tree(load_topology(MONITORED))
    proc = subprocess.run(
        [HGXSERVE, "monitoring", "render", MONITORED, "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("demo-pd: 4 scrape jobs, 10 targets, ")
    for rel, text in first.items():
        assert (tmp_path / rel).read_text() == text
    config = YAML(typ="safe").load((tmp_path / "prometheus/prometheus.yml").read_text())
    assert config["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s"}
    assert [j["job_name"] for j in config["scrape_configs"]] == [
        "hgxserve-demo-pd-proxy",
        "hgxserve-demo-pd-engine",
        "hgxserve-demo-pd-node",
        "hgxserve-demo-pd-dcgm",
    ]
    groups = json.loads((tmp_path / "prometheus/hgxserve/file_sd/demo-pd-engine.json").read_text())
    assert {g["labels"]["job"] for g in groups} == {"hgxserve-engine"}


def test_cli_refuses_an_invalid_topology(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    text = (HERE / "demo-pd-monitored.yml").read_text()
    bad.write_text(text.replace("scrape_interval_s: 2", "scrape_interval_s: 0"))
    proc = subprocess.run(
        [HGXSERVE, "monitoring", "render", str(bad), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert f"{bad}:" in proc.stderr and "$.monitoring.scrape_interval_s" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
