"""`hgxserve bench`: SLA load tests of a deployed topology, and comparisons between runs.

Exit status (README "Exit codes"): 0 every SLA met; 1 an SLA missed (each failing figure
printed); 2 bad arguments or scenarios; 3 the proxy's or an engine's /metrics unreachable; 6 a
round refused (not idle, unclean), the load generator failed, or a round INVALID (a P/D round
whose KV did not all move: its numbers are kept and reported, never a PASS).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from hgxserve.base.defaults import BENCH_RUNS_DIR
from hgxserve.base.errors import ExitCode, UsageError, cli_errors, register_secret
from hgxserve.cli.options import (
    METRICS_KEY_FILE,
    api_key_file,
    progress,
    read_api_key,
    round_timeout,
    runs_dir,
    topology_problems_exit,
)


class _BenchGroup(click.Group):
    """`hgxserve bench TOPOLOGY ...` runs; `hgxserve bench compare RUN...` compares."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_BenchGroup, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """SLA load tests of a deployed topology through its proxy (AIPerf drives the load).

    \b
    hgxserve bench topologies/demo/demo-pd.yml                     # every scenario
    hgxserve bench topologies/demo/demo-pd.yml --scenario short    # one
    hgxserve bench compare bench-runs/RUN_A bench-runs/RUN_B       # side by side, deltas

    Scenarios come from the topology's `bench:` section or NAME.bench.yaml beside it
    (docs/bench.md). Each run keeps run.json, report.md and PNG plots under --out.
    """


@bench.command("run")
@click.argument("topology", type=click.Path(dir_okay=False))
@click.option("--scenario", "-s", "names", multiple=True, help="Run only this scenario (repeat).")
@runs_dir(BENCH_RUNS_DIR, "run")
@click.option("--proxy-url", help="Endpoint to load (default: the topology's proxy address).")
@click.option(
    "--engine-url",
    "engine_urls",
    multiple=True,
    metavar="ENGINE=URL",
    help="Where the controller reaches an engine, when not at the topology's address "
    "(e.g. an SSH tunnel); repeat per engine.",
)
@click.option(
    "--tokenizer",
    help="Local tokenizer directory (the model's own) for AIPerf; default: AIPerf's built-in "
    "tiktoken encoding, which needs its cache offline.",
)
@api_key_file("File holding the proxy's API key (never put the key on the command line).")
@METRICS_KEY_FILE
@click.option(
    "--release-id",
    help="Release the hosts run, recorded with the results (default: read from the hosts "
    "with --inventory, else 'unknown').",
)
@click.option(
    "--inventory",
    "-i",
    envvar="HGXSERVE_PYINFRA_INVENTORY",
    type=click.Path(dir_okay=False),
    help="pyinfra inventory: read each host's running release over SSH (read-only).",
)
@click.option(
    "--from",
    "from_host",
    metavar="HOST",
    help="Send the load from this inventory host (the client network): the connections to the "
    "proxy start there, through an SSH tunnel from the controller, which runs AIPerf. "
    "Needs --inventory.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0, 3600),
    help="Seconds to wait for the proxy and engines to be idle before a round "
    "(default: the bench section's drain_timeout_s).",
)
@round_timeout("Seconds one round (one AIPerf run) may take.")
@click.option(
    "--no-telemetry",
    is_flag=True,
    help="Do not sample GPU memory, power and utilisation on the hosts during the rounds.",
)
@cli_errors
def run_cmd(  # noqa: PLR0913 - a click command: one parameter per option
    topology: str,
    names: tuple[str, ...],
    out_root: str,
    proxy_url: str | None,
    engine_urls: tuple[str, ...],
    tokenizer: str | None,
    api_key_file: str | None,
    metrics_key_file: str | None,
    release_id: str | None,
    inventory: str | None,
    from_host: str | None,
    **timeouts: Any,
) -> None:
    """Run the topology's bench scenarios; exit 1 when an SLA is missed, 6 when a round is no
    valid evidence (a P/D round whose KV did not all move) or could not run."""
    from hgxserve.bench import report
    from hgxserve.bench.api import BenchRequest, exit_code_for, run_deployed
    from hgxserve.bench.scenario import load_bench

    with topology_problems_exit():
        load_bench(topology)
    if tokenizer is not None and not Path(tokenizer, "tokenizer_config.json").is_file():
        raise UsageError(f"{tokenizer}: no tokenizer_config.json (want the model's directory)")
    urls = {}
    for item in engine_urls:
        name, sep, url = item.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise UsageError(f"--engine-url {item!r}: want ENGINE=http://HOST:PORT")
        urls[name] = url
    api_key = read_api_key(api_key_file)
    metrics_key = Path(metrics_key_file).read_text().strip() if metrics_key_file else None
    register_secret(metrics_key)
    req = BenchRequest(
        topology=topology,
        out_root=Path(out_root),
        scenarios=names,
        inventory=inventory,
        from_host=from_host,
        proxy_url=proxy_url,
        engine_urls=urls,
        tokenizer=tokenizer,
        api_key=api_key,
        metrics_key=metrics_key,
        release_id=release_id,
        round_timeout_s=float(timeouts["round_timeout"] or 3600),
        drain_timeout_s=timeouts["drain_timeout"],
        telemetry=not timeouts["no_telemetry"],
    )
    run_dir, result = run_deployed(req, progress)
    path = run_dir / "report.md"
    click.echo(path.read_text())
    click.echo(f"run: {run_dir}\nreport: {path}")
    for bad in result["invalid"]:
        click.echo(f"INVALID: {bad['scenario']} {bad['point']}: {'; '.join(bad['why'])}", err=True)
    for miss in result["verdicts"]:
        click.echo(f"SLA missed: {report.miss_text(miss)}", err=True)
    code = exit_code_for(result)
    if code:
        sys.exit(code)


@bench.command("compare")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option(
    "--max-regression",
    type=click.FloatRange(0, 1000),
    help="Exit 1 when a later run is worse than the first by more than this many percent "
    "(throughput lower, TTFT/TPOT higher), naming each figure.",
)
@click.option(
    "--plots",
    "plots_dir",
    type=click.Path(file_okay=False),
    help="Also draw, per scenario, every run's tok/s/GPU vs tok/s/user (Pareto front, SLA "
    "region) and TTFT/TPOT vs load (SLA line) into this directory, with plots.json.",
)
@cli_errors
def compare_cmd(runs: tuple[str, ...], max_regression: float | None, plots_dir: str | None) -> None:
    """Kept runs side by side per scenario and load, with deltas against the first."""
    from hgxserve.bench import report
    from hgxserve.bench.run import load_run

    loaded = [load_run(r) for r in runs]
    click.echo(report.compare(loaded), nl=False)
    if plots_dir is not None:
        out = Path(plots_dir)
        out.mkdir(parents=True, exist_ok=True)
        labelled = [(f"{r['run_id']} ({r['topology']['name']})", r) for r in loaded]
        for path in report.draw_scenario_figures(labelled, out):
            click.echo(f"plot: {path}")
    if max_regression is not None:
        worse = report.regressions(loaded, max_regression)
        for line in worse:
            click.echo(f"regression: {line}", err=True)
        if worse:
            sys.exit(ExitCode.FOUND)
