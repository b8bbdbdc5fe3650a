"""The runtime stage end to end on real test hosts: the simulated engine (testbed/simwheels.py,
`vllm==0.26.0+sim`, `nixl==1.5.1+sim`) reaches fresh hosts only through deploys/runtime.py, from
a wheelhouse the controller builds and pushes; a second run changes and downloads nothing;
preflight refuses, before any change, a topology whose engine version differs from the installed
one and a P/D topology whose runtime lacks NIXL.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_lab import api_request

from testbed import demo
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
VENV = "/opt/vllm-sim"
PLAIN = "/opt/vllm-sim-plain"  # a runtime installed without the P/D extras
SGLANG = REPO / "topologies/h200-dsv32-sglang-dp8.yml"
SGLANG_VENV = "/opt/sglang-0.5.6"
TEMPLATE = "/etc/hgxserve/files/tool_chat_template_deepseekv32.jinja"
REMOVE_RUNTIMES = (
    f"rm -rf {VENV} {PLAIN} {SGLANG_VENV} /var/lib/hgxserve/runtime /etc/hgxserve/files"
)


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    for name in testbed.names:  # fresh hosts: no releases, no runtimes
        testbed.ssh(name, f"{demo.FORGET_RELEASES}; {REMOVE_RUNTIMES}", check=True)
    demo.prepare(testbed.names, tmp_path_factory.mktemp("demo"))
    yield testbed
    demo.stop_s3()
    for name in testbed.names:
        testbed.ssh(name, f"{demo.FORGET_RELEASES}; rm -rf {PLAIN} {SGLANG_VENV}")


def run(lab: testbed_hosts.Testbed, script: str, *data: str, limit: str | None = None):
    args = [script, *(["--limit", limit] if limit else [])]
    for item in data:
        args += ["--data", item]
    proc = lab.pyinfra(*args, "--data", "health_timeout=75", "--data", "confirm_within=120")
    return proc, re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


def grand_total(text: str) -> tuple[str, ...]:
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text)
    assert match, text[-3000:]
    return match.groups()


def variant(tmp_path: Path, source: Path, replace: dict[str, str]) -> Path:
    text = source.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / source.name
    path.write_text(text)
    return path


def marker(lab: testbed_hosts.Testbed, host: str, venv: str = VENV) -> str:
    return lab.ssh(host, f"cat {venv}/.hgxserve-runtime 2>/dev/null").stdout


def test_fresh_hosts_get_the_runtime_and_serve(lab: testbed_hosts.Testbed) -> None:
    for name in lab.names:
        assert lab.ssh(name, f"test -e {VENV}").returncode != 0
    proc, text = run(lab, "deploys/site.py", f"topology={PD}", "stages=runtime,weights,engines")
    assert proc.returncode == 0, text[-4000:]
    assert "Push the runtime wheelhouse" in text
    assert "GATE-OK" in text
    for name in ("hgx-a", "hgx-b"):  # prefill and decode: the engine and NIXL
        versions = lab.ssh(
            name,
            f"{VENV}/bin/python -c 'import importlib.metadata as m, nixl._api; "
            'print(m.version("vllm"), m.version("nixl"), m.metadata("vllm")["Summary"])\'',
            check=True,
        ).stdout
        assert versions.startswith("0.26.0+sim 1.5.1+sim SIMULATED vllm engine"), versions
        assert '"vllm==0.26.0"' in marker(lab, name) and '"nixl==1.5.1"' in marker(lab, name)
    # the combined engine's host needs no NIXL: only the engine is installed there
    assert lab.ssh("hgx-c", f"{VENV}/bin/python -c 'import nixl'").returncode != 0
    assert '"vllm==0.26.0"' in marker(lab, "hgx-c")
    # served: the unit runs the engine from the venv the stage made
    main = lab.ssh(
        "hgx-b", "systemctl show -p ExecStart --value hgxserve-decode-0.service", check=True
    ).stdout
    assert f"{VENV}/bin/vllm" in main
    assert lab.ssh("hgx-a", "test -e /var/lib/hgxserve/runtime/").returncode == 0
    assert lab.ssh("hgx-a", "ls /var/lib/hgxserve/runtime/").stdout.strip() == ""  # cleaned up


def test_second_run_changes_and_downloads_nothing(lab: testbed_hosts.Testbed) -> None:
    before = {name: marker(lab, name) for name in lab.names}
    proc, text = run(lab, "deploys/site.py", f"topology={PD}", "stages=runtime,weights,engines")
    assert proc.returncode == 0, text[-4000:]
    _, success, error, _ = grand_total(text)
    assert (success, error) == ("-", "-"), text[-3000:]
    assert "runtime wheelhouse" not in text  # the controller built nothing, pushed nothing
    assert "Push the runtime wheelhouse" not in text
    assert {name: marker(lab, name) for name in lab.names} == before


def test_other_engine_version_fails_preflight_before_any_change(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    newer = variant(tmp_path, PD, {"version: 0.26.0": "version: 0.27.0"})
    units = lab.ssh("hgx-b", "systemctl show -p MainPID --value hgxserve-decode-0").stdout
    proc, text = run(lab, "deploys/site.py", f"topology={newer}", limit="hgx-b")
    assert proc.returncode != 0
    assert (
        f"hgx-b: engine.version: expected vllm 0.27.0 in {VENV}, found 0.26.0+sim "
        "(a runtime venv is not changed in place: releases start from it; install 0.27.0 "
        "into its own runtime.venv)"
    ) in text, text[-4000:]
    assert "Install vllm==0.27.0" not in text and "Traceback" not in text
    assert '"vllm==0.26.0"' in marker(lab, "hgx-b")
    assert lab.ssh("hgx-b", "systemctl show -p MainPID --value hgxserve-decode-0").stdout == units


def test_runtime_without_nixl_fails_preflight_for_pd(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    plain = variant(tmp_path, BASELINE, {f"venv: {VENV}}}": f"venv: {PLAIN}}}"})
    proc, text = run(lab, "deploys/runtime.py", f"topology={plain}", limit="hgx-a")
    assert proc.returncode == 0, text[-4000:]
    assert lab.ssh("hgx-a", f"{PLAIN}/bin/python -c 'import nixl'").returncode != 0
    pd_dir = tmp_path / "pd"
    pd_dir.mkdir()
    pd = variant(pd_dir, PD, {f"venv: {VENV}}}": f"venv: {PLAIN}}}"})
    proc, text = run(lab, "deploys/preflight.py", f"topology={pd}", limit="hgx-a")
    assert proc.returncode != 0
    assert (
        f"hgx-a: runtime.nixl: expected nixl._api importable in {PLAIN} (vLLM P/D over NIXL), "
        "found ModuleNotFoundError: No module named 'nixl'"
    ) in text, text[-4000:]
    # the runtime stage adds NIXL to that venv (pip only adds); the baseline's pins stay recorded
    proc, text = run(lab, "deploys/site.py", f"topology={pd}", "stages=runtime", limit="hgx-a")
    assert proc.returncode == 0, text[-4000:]
    assert "Install vllm==0.26.0 nixl==1.5.1" in text, text[-4000:]
    assert lab.ssh("hgx-a", f"{PLAIN}/bin/python -c 'import nixl._api'").returncode == 0
    proc, text = run(lab, "deploys/runtime.py", f"topology={plain}", limit="hgx-a")
    assert proc.returncode == 0 and grand_total(text)[1:3] == ("-", "-"), text[-3000:]


def test_wheelhouse_failure_is_a_clear_error(lab: testbed_hosts.Testbed, tmp_path: Path) -> None:
    missing = variant(tmp_path, BASELINE, {"version: 0.26.0": "version: 0.99.0",
                                           f"venv: {VENV}}}": f"venv: {PLAIN}-x}}"})  # fmt: skip
    proc, text = run(lab, "deploys/runtime.py", f"topology={missing}", limit="hgx-a")
    assert proc.returncode != 0
    assert "runtime wheelhouse: pip download vllm==0.99.0 failed:" in text, text[-3000:]
    assert "Traceback" not in text
    assert lab.ssh("hgx-a", f"test -e {PLAIN}-x").returncode != 0


def sglang_on_test_hosts(out: Path) -> tuple[Path, str]:
    """The shipped SGLang DP8 topology on hgx-a: hosts and model swapped for the demo lab's, the
    template's source a local file (SGLang's own stays out of this repository)."""
    text = SGLANG.read_text()
    demo_text = BASELINE.read_text()
    hosts = demo_text[demo_text.index("hosts:\n") : demo_text.index("model:\n")]
    model = demo_text[demo_text.index("model:\n") : demo_text.index("defaults:\n")]
    # trust_remote_code: the demo model's pin, from the test hosts' inventory (model_pins)
    model = model.replace(
        "  path: /models/tiny\n", "  path: /models/tiny\n  digest_from: inventory\n"
    )
    text = text[: text.index("hosts:\n")] + hosts + model + text[text.index("engines:\n") :]
    text = text.replace("h200-a", "hgx-a")
    template = out / "tool_chat_template_deepseekv32.jinja"
    template.write_text(
        "{# test template #}{% for m in messages %}{{ m['content'] }}{% endfor %}\n"
    )
    sha = hashlib.sha256(template.read_bytes()).hexdigest()
    text, count = re.subn(
        r"    source: https://\S+\n    sha256: [0-9a-f]{64}",
        f"    source: {template.name}\n    sha256: {sha}",
        text,
    )
    assert count == 1
    path = out / "sglang-dp8.yml"
    path.write_text(text)
    return path, sha


def test_sglang_dp8_starts_with_its_template_delivered(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    topology, sha = sglang_on_test_hosts(tmp_path)
    lab.ssh("hgx-a", f"rm -rf {SGLANG_VENV} /etc/hgxserve/files", check=True)
    stages = "stages=runtime,weights,engines"
    proc, text = run(lab, "deploys/site.py", f"topology={topology}", stages)
    assert proc.returncode == 0, text[-4000:]
    assert "GATE-OK" in text
    assert lab.ssh("hgx-a", f"sha256sum {TEMPLATE}", check=True).stdout.split()[0] == sha
    version = lab.ssh(
        "hgx-a", f"{SGLANG_VENV}/bin/python -c 'import importlib.metadata as m; "
        "print(m.version(\"sglang\"))'", check=True,
    ).stdout.strip()  # fmt: skip
    assert version == "0.5.6.post2+sim"
    unit = lab.ssh("hgx-a", "systemctl cat hgxserve-sglang-0.service", check=True).stdout
    assert f"runtime check-files {TEMPLATE}={sha}" in unit
    assert f"--chat-template {TEMPLATE}" in unit
    body = {"model": "tiny", "prompt": "Only answer: SGL", "max_tokens": 4}
    request = api_request("http://10.77.0.11:8000/v1/completions", body)  # the proxy's auth
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert json.loads(resp.read())["choices"][0]["text"]
    # again: nothing changes (venv, template, release)
    proc, text = run(lab, "deploys/site.py", f"topology={topology}", stages)
    assert proc.returncode == 0, text[-4000:]
    assert grand_total(text)[1:3] == ("-", "-"), text[-3000:]
    # a unit never starts on a template other than the pinned one
    lab.ssh("hgx-a", f"cp {TEMPLATE} /tmp/t.keep && echo changed >> {TEMPLATE}", check=True)
    check = lab.ssh("hgx-a", f"/opt/hgxserve/bin/hgxserve runtime check-files {TEMPLATE}={sha}")
    lab.ssh("hgx-a", f"mv /tmp/t.keep {TEMPLATE}", check=True)
    assert check.returncode == 1 and f"expected {sha} (run the runtime stage)" in check.stderr


def test_hosts_install_from_an_inventory_named_index(
    lab: testbed_hosts.Testbed, tmp_path: Path
) -> None:
    # a PEP 503 index of the simulated wheels, served on the controller bridge as a lab mirror
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_runtime import simple_index

    simple_index(testbed_hosts.WHEELS_DIR, tmp_path / "index")
    with socket.socket() as sock:
        sock.bind((testbed_hosts.BRIDGE_ADDRESS, 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", testbed_hosts.BRIDGE_ADDRESS, str(port),
         "--directory", str(tmp_path / "index")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    venv = f"{PLAIN}-index"
    # the lab's hash lock: every wheel the mirror serves, by version and sha256
    lock, forged = tmp_path / "lab.lock", tmp_path / "forged.lock"
    lines = []
    for wheel in sorted(testbed_hosts.WHEELS_DIR.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{digest}")
    lock.write_text("# pip-compile --generate-hashes\n" + "\n".join(lines) + "\n")

    # the same lock with the engine's hash changed: what a mirror serving another file looks like
    def flip(match: re.Match) -> str:
        return match.group(1) + ("1" if match.group(2) == "0" else "0")

    forged.write_text(
        re.sub(r"(vllm==\S+ \\\n    --hash=sha256:)([0-9a-f])", flip, lock.read_text())
    )
    assert forged.read_text() != lock.read_text()
    try:
        time.sleep(0.5)
        topology = variant(tmp_path, BASELINE, {f"venv: {VENV}}}": f"venv: {venv}}}"})
        url = f"http://{testbed_hosts.BRIDGE_ADDRESS}:{port}/simple"
        data = [f"topology={topology}", "runtime_source=index", f"runtime_index_url={url}"]
        # no lock and no explicit opt-out: refused before anything runs on the host
        bare, text = run(lab, "deploys/runtime.py", *data, limit="hgx-a")
        assert bare.returncode != 0 and "needs runtime_index_lock=PATH" in text, text[-3000:]
        assert "Traceback" not in text
        # a file that does not match the lock's hash: pip refuses it, nothing is marked
        bad, text = run(lab, "deploys/runtime.py", *data, f"runtime_index_lock={forged}",
                        limit="hgx-a")  # fmt: skip
        assert bad.returncode != 0 and "DO NOT MATCH THE HASHES" in text.upper(), text[-3000:]
        assert lab.ssh("hgx-a", f"test -e {venv}/.hgxserve-runtime").returncode != 0
        data.append(f"runtime_index_lock={lock}")
        proc, text = run(lab, "deploys/runtime.py", *data, limit="hgx-a")
        assert proc.returncode == 0, text[-4000:]
        assert "Push the runtime wheelhouse" not in text
        installed = marker(lab, "hgx-a", venv)
        assert f'"source": "index {url}"' in installed
        assert hashlib.sha256(lock.read_bytes()).hexdigest() in installed
        again, text = run(lab, "deploys/runtime.py", *data, limit="hgx-a")
        assert again.returncode == 0 and grand_total(text)[1:3] == ("-", "-"), text[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=10)
        lab.ssh("hgx-a", f"rm -rf {venv}")
