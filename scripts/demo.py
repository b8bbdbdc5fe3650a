"""The built-in demo, end to end on this machine, printing what it does as it goes.

Three local test hosts (systemd-nspawn, real systemd and sshd, simulated 8 x H200 each), a local
S3 holding a tiny model, the simulated engine as vLLM. It validates the demo topologies, checks
host facts, syncs and verifies the weights, deploys the baseline, switches to P/D (prefill on
hgx-a, decode on hgx-b, combined + proxy on hgx-c), sends completions through the proxy, goes
back to the baseline, and tears everything down (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed import demo  # noqa: E402
from testbed import hosts as testbed_hosts  # noqa: E402

BASELINE = "topologies/demo/demo-baseline.yml"
PD = "topologies/demo/demo-pd.yml"
BIN = REPO / ".venv/bin"


def step(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m", flush=True)


def run(*argv: str) -> None:
    print("$ " + " ".join(argv), flush=True)
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"demo: `{' '.join(argv)}` failed (exit {proc.returncode})")
    print(f"   ({time.monotonic() - started:.1f} s)", flush=True)


def pyinfra(*args: str) -> None:
    run(str(BIN / "pyinfra"), "-y", "inventory/testhosts.py", *args)


def complete(address: str, prompt: str) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    req = urllib.request.Request(
        f"http://{address}:8000/v1/completions",
        data=body.encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {demo.DEMO_API_KEY}",
        },
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = json.loads(resp.read())
    text = answer["choices"][0]["text"]
    print(f"   POST http://{address}:8000/v1/completions ({len(prompt)} chars) -> {text!r}")
    return str(text)


def metric(address: str, port: int, name: str) -> float:
    """First sample of a metric: `name` alone, or `name{labels}` written out in full."""
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave hosts and S3 running")
    args = parser.parse_args()

    step("Validate the demo topologies")
    run(str(BIN / "hgxserve"), "validate", BASELINE, PD)
    run(str(BIN / "hgxserve"), "plan", PD)

    step("Boot 3 test hosts (systemd-nspawn; the root filesystem is built once and cached)")
    bed = testbed_hosts.up(3, "h200")
    testbed_hosts.take_lease(os.getpid())  # nobody tears the hosts down under the demo
    try:
        step("Local S3 on the test network with a tiny model and its manifest")
        with tempfile.TemporaryDirectory() as work:
            demo.prepare(bed.names, Path(work))
        print(f"   s3://{demo.BUCKET}/{demo.PREFIX} at {demo.S3_ENDPOINT}")

        step("Preflight: host facts (nvidia-smi, RDMA, disk) against the topology")
        pyinfra("deploys/preflight.py", "--data", f"topology={BASELINE}",
                "--data", "preflight=hardware")  # fmt: skip

        step("Deploy the baseline: the engine runtime, weights (sync + verify), then the release")
        pyinfra("deploys/site.py", "--data", f"topology={BASELINE}",
                "--data", "stages=runtime,weights,engines")  # fmt: skip
        complete("10.77.0.11", "Only answer: hello")

        step("Apply the baseline again: nothing changes, nothing restarts")
        pyinfra("deploys/site.py", "--data", f"topology={BASELINE}",
                "--data", "stages=runtime,weights,engines")  # fmt: skip

        step("Switch to P/D: prefill hgx-a, decode hgx-b, combined + proxy hgx-c")
        pyinfra("deploys/site.py", "--data", f"topology={PD}",
                "--data", "stages=runtime,weights,engines")  # fmt: skip
        before = metric("10.77.0.12", 8200, "vllm:nixl_xfer_time_seconds_count")
        long_prompt = " ".join(
            f"a long prompt goes through prefill and decode {i}." for i in range(12)
        )
        complete("10.77.0.13", long_prompt)
        after = metric("10.77.0.12", 8200, "vllm:nixl_xfer_time_seconds_count")
        print(f"   decode pulled KV over NIXL {after - before:.0f} times (one per TP rank)")
        if after <= before:
            raise SystemExit("demo: the long prompt was served without a KV transfer")
        routed = 'hgxserve_proxy_requests_total{route="combined",endpoint="completions",code="2xx"}'
        before = metric("10.77.0.13", 8000, routed)
        complete("10.77.0.13", "short prompt")
        combined = metric("10.77.0.13", 8000, routed) - before
        print(f"   the proxy sent {combined:.0f} short prompt(s) to the combined engine on hgx-c")
        if combined != 1:
            raise SystemExit("demo: the short prompt did not go to the combined engine")

        step("Bench the P/D path the seed-003 way: clean, valid rounds, SLA at p95, plots (AIPerf)")
        tokenizer = Path(tempfile.mkdtemp(prefix="demo-tokenizer-"))  # the tiny model's own
        subprocess.run(
            [str(REPO / ".venv-aiperf/bin/python"), str(REPO / "testbed/tiny_llama.py"),
             "--tokenizer-only", str(tokenizer)],
            check=True, capture_output=True,
        )  # fmt: skip
        # the load starts on hgx-a (the client network) through an SSH tunnel; each engine's
        # /metrics is read through its own host (combined-0 listens on hgx-c's loopback only)
        runs = REPO / "bench-runs"
        # seed 003's shapes (128/64 at C1 and C8, 4096/128 at C4, p95) scaled to the tiny model
        run(str(BIN / "hgxserve"), "bench", PD, "--scenario", "seed003-short",
            "--scenario", "seed003-long",
            "--tokenizer", str(tokenizer), "--inventory", "inventory/testhosts.py",
            "--from", "hgx-a", "--api-key-file", str(demo.api_key_file(tokenizer)),
            "--out", str(runs))  # fmt: skip
        kept = max((p for p in runs.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        plots = [
            kept / name
            for name in (
                "throughput.png",
                "ttft.png",
                "tpot.png",
                "pareto-seed003-short.png",
                "latency-seed003-long.png",
            )
        ]
        missing = [p.name for p in plots if not p.is_file()]
        if missing:
            raise SystemExit(f"demo: the bench wrote no {', '.join(missing)} in {kept}")
        print(f"   kept: {kept.relative_to(REPO)}/ run.json, report.md, "
              + ", ".join(p.name for p in plots))  # fmt: skip

        step("Back to the baseline, all hosts together")
        pyinfra("deploys/rollback.py", "--data", "to=baseline")
        complete("10.77.0.11", "Only answer: hello")
        step("Done")
        names = ", ".join(p.name for p in plots)
        print(f"   the bench's report and plots: {kept.relative_to(REPO)}/report.md, {names}")
    finally:
        others = testbed_hosts.drop_lease(os.getpid())
        if not args.keep:
            step("Tear down: local S3 and the test hosts")
            demo.stop_s3()
            if others:
                print(f"   test hosts left up: also in use by PIDs {others}")
            else:
                testbed_hosts.down()


if __name__ == "__main__":
    main()
