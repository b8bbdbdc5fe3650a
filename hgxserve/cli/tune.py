"""`hgxserve tune SPEC`: deploy candidate topologies, bench each, keep the best under the SLA.

Exit status (README "Exit codes"): 0 a candidate met the SLA and the lab was left as the SPEC
says (or `--dry-run` found survivors); 1 no candidate met the SLA (the lab is left on the
baseline) or, with `--dry-run`, every candidate was pruned; 2 a bad SPEC, option or run
directory; 6 the final release failed; 130 interrupted (Ctrl-C or SIGTERM: the running deploy is
stopped, `--resume` carries on).
"""

from __future__ import annotations

import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from hgxserve.base.defaults import TUNE_DEPLOY_TIMEOUT_S, TUNE_RUNS_DIR
from hgxserve.base.errors import ExitCode, HgxserveError, UsageError, cli_errors
from hgxserve.cli.options import (
    IN_FILE,
    METRICS_KEY_FILE,
    api_key_file,
    progress,
    read_api_key,
    round_timeout,
    runs_dir,
    topology_problems_exit,
)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_dir(spec: Any, out_root: Path, resume: str | None) -> tuple[Path, dict[str, Any]]:
    """The run directory and its state: --resume's, an unfinished run of the same SPEC, or new."""
    from hgxserve.tune import state

    if resume is not None:
        run_dir = Path(resume)
        return run_dir, state.load(run_dir, spec.digest)
    found = state.unfinished(out_root, spec.digest)
    if found is not None:
        progress(f"resuming the unfinished tune {found} (same SPEC)")
        return found, state.load(found, spec.digest)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_dir = out_root / f"{stamp}-{Path(spec.file).stem.split('.')[0]}"
    run_dir.mkdir(parents=True, exist_ok=False)
    tune = state.new_state(spec.file, spec.digest)
    state.save(run_dir, tune)
    return run_dir, tune


@click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option(
    "--resume",
    type=click.Path(file_okay=False, exists=True),
    help="Carry on a stopped tune in this run directory (finished candidates are not run again). "
    "Without it, an unfinished run of the same SPEC under --out is resumed.",
)
@runs_dir(TUNE_RUNS_DIR, "tune")
@click.option(
    "--inventory",
    "-i",
    type=IN_FILE,
    help="pyinfra inventory (default: the SPEC's `inventory`).",
)
@click.option("--tokenizer", help="Local tokenizer directory for the bench (the model's own).")
@api_key_file("File holding the proxy's API key, for the bench.")
@METRICS_KEY_FILE
@click.option("--from", "from_host", metavar="HOST", help="Send the bench load from this host.")
@round_timeout("Seconds one bench round may take.")
@click.option(
    "--deploy-timeout",
    type=click.FloatRange(60, 86400),
    default=TUNE_DEPLOY_TIMEOUT_S,
    show_default=True,
    help="Seconds one candidate's deploy (pyinfra deploys/site.py) may take.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Prune and print the estimate only: nothing is deployed.",
)
@cli_errors
def tune(  # noqa: PLR0913 - a click command: one parameter per option
    spec_file: str,
    resume: str | None,
    out_root: str,
    inventory: str | None,
    tokenizer: str | None,
    api_key_file: str | None,
    metrics_key_file: str | None,
    from_host: str | None,
    round_timeout: float,
    deploy_timeout: float,
    dry_run: bool,
) -> None:
    """Deploy each candidate topology of SPEC through a normal release, bench it with the base's
    scenarios and seeds, and leave the lab on the best one that meets the SLA.

    \b
    hgxserve tune topologies/demo/demo.tune.yaml --dry-run      # prune + wall-time estimate
    hgxserve tune SPEC --tokenizer /models/tiny --api-key-file KEY
    hgxserve tune SPEC --resume tune-runs/20260101T000000Z-demo   # carry on a stopped tune

    Candidates that fail `validate` or the memory / KV-cache fit estimate are pruned before any
    deploy, each with every reason. Results, the state file, report.md / report.json and plots
    are kept in the tune's run directory under --out (docs/tune.md).
    """
    from hgxserve.tune import loop, prune, report
    from hgxserve.tune.spec import load_spec

    with topology_problems_exit():
        spec = load_spec(spec_file)
        scenarios = loop.scenarios_of(spec)
    inv = Path(inventory) if inventory else spec.inventory
    if inv is None:
        raise UsageError(f"{spec_file}: no inventory: set `inventory:` or give --inventory")
    if dry_run:
        _dry_run(spec, prune, scenarios[1])
        return
    api_key = read_api_key(api_key_file)
    metrics_key = read_api_key(metrics_key_file)
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir, state = _run_dir(spec, Path(out_root), resume)
    progress(f"tune {run_dir}")
    opts = loop.TuneOptions(
        run_dir=run_dir,
        inventory=inv.resolve(),
        progress=progress,
        tokenizer=tokenizer,
        api_key=api_key,
        metrics_key=metrics_key,
        from_host=from_host,
        round_timeout_s=round_timeout,
        deploy_timeout_s=deploy_timeout,
        scenarios=scenarios,
    )
    final = loop.run_tune(spec, opts, state)["final"]
    path = report.write(run_dir, state)
    click.echo(path.read_text())
    click.echo(f"run: {run_dir}\nreport: {path}")
    if not final["deployed"]:
        raise HgxserveError(
            f"the final release of {final['left_on']} failed: {final.get('reason')}"
        )
    if final["winner"] is None:
        sys.exit(ExitCode.FOUND)


def _dry_run(spec: Any, prune: Any, scenarios: list[Any]) -> None:
    """Prune and estimate, print; exit 1 when every candidate was pruned."""
    import tempfile

    from hgxserve.tune import matrix
    from hgxserve.tune.estimate import estimate

    with tempfile.TemporaryDirectory(prefix="hgxserve-tune-") as tmp:
        files = (
            [p for p, _ in matrix.expand(spec.base, spec.matrix, Path(tmp))]
            if spec.matrix
            else list(spec.candidates)
        )
        checked = [prune.check(f) for f in files]
        for c in checked:
            name = c.topology.name if c.topology else c.file.name
            click.echo(f"{'pruned' if c.pruned else 'keep  '} {name} ({c.file.name})")
            for why in c.reasons:
                click.echo(f"    {why}")
        survivors = [c.topology for c in checked if not c.pruned]
        _, lines = estimate(survivors, scenarios, {})
    click.echo("\n".join(lines))
    if not survivors:
        sys.exit(ExitCode.FOUND)
