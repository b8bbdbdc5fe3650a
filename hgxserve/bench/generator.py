"""The load generator: AIPerf (`aiperf profile`), driven one round at a time.

Each round is one `aiperf profile` run: synthetic prompts of a fixed length (stddev 0), or the
scenario's dataset replayed (AIPerf's `single_turn` JSONL, hgxserve.bench.dataset), a fixed
output length with `ignore_eos` (the seeds' `--ignore-eos`), temperature 0, streamed, a fixed
seed, warm-up requests first, then either a concurrency or a request rate capped by a
concurrency. Its JSON export (`profile_export_aiperf.json`) gives the client-side figures.

Token counting needs no download: `--tokenizer` is the served model's own directory when one
is given (a local path), else AIPerf's built-in tiktoken encoding.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hgxserve.base.errors import ExitCode, HgxserveError
from hgxserve.bench.scenario import LoadPoint, Scenario

EXPORT_FILE = "profile_export_aiperf.json"
# AIPerf metric tag -> our name; times in AIPerf's export are milliseconds.
_LATENCIES = {
    "time_to_first_token": "ttft_ms",
    "inter_token_latency": "tpot_ms",
    "request_latency": "e2e_ms",
}
_RATES = {
    "request_throughput": "request_throughput",
    "output_token_throughput": "output_token_throughput",
    "total_token_throughput": "total_token_throughput",
    "output_token_throughput_per_user": "output_tok_s_per_user",
}
_COUNTS = {
    "request_count": "requests",
    "error_request_count": "errors",
    "benchmark_duration": "duration_s",
}


class GeneratorError(HgxserveError):
    """AIPerf could not run the round, or wrote nothing we can read."""

    exit_code = ExitCode.FAILED


def aiperf_command() -> list[str]:
    """How to start AIPerf: the `aiperf` beside this Python (scripts/setup.sh links its own
    venv's there), else on PATH."""
    beside = Path(sys.executable).with_name("aiperf")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("aiperf")
    if found:
        return [found]
    raise GeneratorError(
        "AIPerf is not installed: it has a venv of its own (pyproject.toml's dependency group "
        "`aiperf`; bash scripts/setup.sh makes .venv-aiperf and links .venv/bin/aiperf; see "
        "docs/bench.md)"
    )


@dataclass(frozen=True)
class RoundArgs:
    url: str
    model: str
    scenario: Scenario
    point: LoadPoint
    seed: int
    out_dir: Path
    tokenizer: str | None = None
    input_file: Path | None = None  # the scenario's dataset as AIPerf single_turn JSONL


def _prompt_args(args: RoundArgs) -> list[str]:
    """Synthetic prompts of a fixed length, or the dataset's prompts replayed."""
    s = args.scenario
    if args.input_file is not None:
        return ["--custom-dataset-type", "single_turn", "--input-file", str(args.input_file)]
    out = [
        "--synthetic-input-tokens-mean", str(s.input),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(s.output),
        "--output-tokens-stddev", "0",
    ]  # fmt: skip
    if s.prefix_prompts is not None:
        out += ["--num-prefix-prompts", str(s.prefix_prompts)]
        out += ["--prefix-prompt-length", str(s.prefix_tokens)]
    if s.conversations is not None:
        out += ["--conversation-num", str(s.conversations)]
        out += ["--conversation-turn-mean", str(s.turns), "--conversation-turn-stddev", "0"]
    return out


def argv(args: RoundArgs) -> list[str]:
    """The `aiperf profile` arguments of one round."""
    s, p = args.scenario, args.point
    cmd = [
        *aiperf_command(),
        "profile",
        "--model", args.model,
        "--url", args.url,
        "--endpoint-type", "chat" if s.api == "chat" else "completions",
        "--streaming",
        "--tokenizer", args.tokenizer or "builtin",
        *_prompt_args(args),
        "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", "temperature:0",
        "--use-server-token-count",
        "--random-seed", str(args.seed),
        "--warmup-request-count", str(s.warmup_for(p)),
        "--artifact-dir", str(args.out_dir),
        "--ui-type", "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
    ]  # fmt: skip
    if p.rate is None:
        cmd += ["--concurrency", str(p.concurrency)]
    else:
        cmd += ["--request-rate", f"{p.rate:g}", "--concurrency", str(p.concurrency)]
        cmd += ["--arrival-pattern", "constant"]
    requests = s.requests_for(p)
    if s.duration_s is not None:
        cmd += ["--benchmark-duration", f"{s.duration_s:g}"]
    if requests is not None:
        cmd += ["--request-count", str(requests)]
    return cmd


def _stat(entry: Any, key: str) -> float | None:
    if isinstance(entry, dict) and isinstance(entry.get(key), int | float):
        return float(entry[key])
    return None


def parse_export(path: Path) -> dict[str, float | None]:
    """Client-side figures from AIPerf's JSON export: latencies (avg, p50/p90/p95/p99),
    throughputs and counts."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GeneratorError(f"{path}: cannot read AIPerf's export ({exc})") from None
    records = data.get("records", data) if isinstance(data, dict) else {}
    out: dict[str, float | None] = {}
    for tag, name in _LATENCIES.items():
        entry = records.get(tag)
        for stat in ("avg", "p50", "p90", "p95", "p99"):
            out[f"{name}_{stat}"] = _stat(entry, stat)
    for tag, name in _RATES.items():
        out[name] = _stat(records.get(tag), "avg")
    for tag, name in _COUNTS.items():
        out[name] = _stat(records.get(tag), "avg") or 0.0
    if out.get("ttft_ms_avg") is None:
        raise GeneratorError(f"{path}: no time_to_first_token in AIPerf's export")
    return out


def find_export(out_dir: Path) -> Path:
    """The run's whole export (not the per-phase copies under phases/)."""
    path = out_dir / EXPORT_FILE
    if not path.exists():
        raise GeneratorError(f"AIPerf wrote no {EXPORT_FILE} in {out_dir}")
    return path


def run_round(
    args: RoundArgs, *, progress: Callable[[str], None], timeout_s: float
) -> dict[str, float | None]:
    """Run one round; its figures. AIPerf's own output goes to `out_dir/aiperf.log`."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.scenario.dataset is not None and args.input_file is None:
        from hgxserve.bench.dataset import load_dataset, write_input

        entries, _ = load_dataset(args.scenario.dataset, args.scenario.output)
        args = replace(args, input_file=write_input(entries, args.out_dir / "dataset.jsonl"))
    cmd = argv(args)
    # Not HF_HUB_OFFLINE: AIPerf 0.13.0 then looks a local tokenizer path up as a hub repo id
    # and fails (HFValidationError); a local directory needs no network without it.
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    log_path = args.out_dir / "aiperf.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                if time.monotonic() - started > timeout_s:
                    proc.terminate()
                    proc.wait(30)
                    raise GeneratorError(f"AIPerf ran past {timeout_s:.0f} s; see {log_path}")
                time.sleep(1)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
            raise
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-8:]
        raise GeneratorError(
            f"AIPerf exited {proc.returncode}; see {log_path}:\n  " + "\n  ".join(tail)
        )
    figures = parse_export(find_export(args.out_dir))
    progress(f"    aiperf done in {time.monotonic() - started:.1f} s")
    return figures
