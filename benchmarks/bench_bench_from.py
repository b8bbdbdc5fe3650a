"""What `hgxserve bench --from HOST` costs: the same scenario through the demo P/D proxy on the
3 local test hosts, from the controller directly, `--from hgx-a` (our in-process SSH tunnel),
and through OpenSSH's own `ssh -N -L` tunnel via hgx-a (the usual tool), alternating rounds.

Brings the test hosts up (reusing running ones), deploys the demo P/D topology (runtime,
weights, engines), then runs each case `--rounds` times: one AIPerf round each (ISL 240 /
OSL 32, concurrency 4, 48 requests, the simulated engine at 10 ms per token). Engines' /metrics
are read through their hosts (`--inventory`) in every case. Needs root. Prints a table; asserts
nothing about the time. Run it holding the e2e lock.

    .venv/bin/python benchmarks/bench_bench_from.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed import demo  # noqa: E402
from testbed import hosts as testbed_hosts  # noqa: E402

TOPOLOGY = REPO / "topologies/demo/demo-pd.yml"
PYINFRA = [str(REPO / ".venv/bin/pyinfra"), "-y", "inventory/testhosts.py"]
SCENARIO = (
    "bench:\n  drain_timeout_s: 20\n  scenarios:\n"
    "    - {name: m, input: 240, output: 32, concurrency: [4], requests: 48, seeds: [1]}\n"
)
FIGURES = ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "output_token_throughput")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench(work: Path, key: Path, out: Path, extra: list[str]) -> dict[str, float]:
    argv = [
        str(REPO / ".venv/bin/hgxserve"), "bench", str(work / "demo-pd.yml"),
        "--tokenizer", str(work / "tok"), "--inventory", "inventory/testhosts.py",
        "--api-key-file", str(key), "--out", str(out), *extra,
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (run,) = [json.loads(p.read_text()) for p in out.glob("*/run.json")]
    client = run["points"][0]["client"]
    return {k: float(client[k]) for k in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    bed = testbed_hosts.up(3, "h200")
    work = Path(tempfile.mkdtemp(prefix="bench-from-"))
    demo.prepare(bed.names, work)
    try:
        site = ["deploys/site.py", "--data", f"topology={TOPOLOGY}",
                "--data", "stages=runtime,weights,engines"]  # fmt: skip
        subprocess.run([*PYINFRA, *site], cwd=REPO, check=True, capture_output=True)
        subprocess.run(
            [str(REPO / ".venv-aiperf/bin/python"), str(REPO / "testbed/tiny_llama.py"),
             "--tokenizer-only", str(work / "tok")],
            check=True, capture_output=True,
        )  # fmt: skip
        (work / "demo-pd.yml").write_text(TOPOLOGY.read_text())
        (work / "demo-pd.bench.yaml").write_text(SCENARIO)
        key = demo.api_key_file(work)
        port = free_port()
        ssh = bed.ssh_argv("hgx-a")
        ssh[-1:-1] = ["-N", "-L", f"127.0.0.1:{port}:10.77.0.13:8000"]
        cases = {
            "controller -> proxy (direct)": [],
            "--from hgx-a (hgxserve tunnel)": ["--from", "hgx-a"],
            "ssh -N -L via hgx-a (OpenSSH)": ["--proxy-url", f"http://127.0.0.1:{port}"],
        }
        results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        tunnel = subprocess.Popen(ssh, stdin=subprocess.DEVNULL)
        try:
            time.sleep(2)
            for i in range(args.rounds):
                for name, extra in cases.items():
                    out = work / f"runs-{i}-{len(results[name])}-{name.split()[0]}"
                    results[name].append(bench(work, key, out, extra))
        finally:
            tunnel.terminate()
            tunnel.wait(10)
        print(f"\nbench through the demo P/D proxy, {args.rounds} alternating rounds each "
              "(medians; ISL 240 / OSL 32, concurrency 4, 48 requests)")  # fmt: skip
        print(f"{'load path':32} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} "
              f"{'TPOT p90':>9} {'out tok/s':>10}")  # fmt: skip
        for name, rows in results.items():
            med = {k: statistics.median(r[k] for r in rows) for k in FIGURES}
            print(
                f"{name:32} {med['ttft_ms_p50']:7.1f}ms {med['ttft_ms_p90']:7.1f}ms "
                f"{med['tpot_ms_p50']:7.2f}ms {med['tpot_ms_p90']:7.2f}ms "
                f"{med['output_token_throughput']:10.0f}"
            )
    finally:
        demo.stop_s3()


if __name__ == "__main__":
    main()
