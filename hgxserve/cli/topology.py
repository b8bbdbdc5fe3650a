"""`hgxserve validate` and `hgxserve plan`.

Exit codes (both commands): 0 valid, 1 errors (or warnings with --strict), 2 a file could not be
read or parsed. Problems print as `file:line:col: $.path: message`; nothing prints a traceback.
The reports are `hgxserve.topology.results` (validate) and `hgxserve.plan` (plan).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from hgxserve.topology.model import Topology
from hgxserve.topology.results import (
    EXIT_ERRORS,
    EXIT_UNREADABLE,
    exit_code,
    problems_text,
    results_json,
    rules_text,
    safe_check,
)

FORMAT = click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Output format.",
)


@click.command("validate")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "markdown"]),
    default="text",
    show_default=True,
    help="Output format (markdown: with --list-rules, the rule table of docs/topology.md).",
)
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
@click.option("--list-rules", is_flag=True, help="List rule ids, severities and summaries.")
def validate(files: tuple[str, ...], fmt: str, strict: bool, list_rules: bool) -> None:
    """Check topology files: YAML, schema and the rules; print every problem.

    \b
    hgxserve validate topologies/h20-v4flash-tp8.yml
    hgxserve validate --strict --format json topologies/*.yml
    hgxserve validate --list-rules
    hgxserve validate --list-rules --format markdown   # the table of docs/topology.md

    Exit 0 valid, 1 errors (or warnings with --strict), 2 unreadable or unparseable.
    """
    if list_rules:
        click.echo(rules_text(fmt))
        return
    if fmt == "markdown":
        raise click.UsageError("--format markdown lists the rules: use it with --list-rules")
    if not files:
        raise click.UsageError("give at least one topology file (or --list-rules)")
    results = [safe_check(f) for f in files]
    if fmt == "json":
        click.echo(json.dumps(results_json(results, strict), indent=2))
    else:
        click.echo("\n".join(problems_text(results, strict)))
    sys.exit(exit_code(results, strict))


def _echo_plan(data: dict[str, Any], warnings: Sequence[Any], fmt: str) -> None:
    """The plan as JSON, or as text (warnings on stderr, then the last release's numbers)."""
    from hgxserve.plan.text import plan_text

    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
        return
    for problem in warnings:
        click.echo(problem.text(), err=True)
    click.echo("\n".join(plan_text(data)))
    last = data.get("last_release")
    if last is not None:
        from hgxserve.release.kvcap import last_release_lines

        click.echo("\n".join(last_release_lines(last["from"], last["engines"])))


def _checked_trust(file: str, topo: Topology, inventory: str | None, fmt: str) -> dict[str, Any]:
    """The trust root for the plan; the deploy's refusals exit 1 (on stderr), an unpinned
    model is a warning."""
    from hgxserve.plan.report import UNPINNED, trust_plan

    trust, refusals = trust_plan(topo, inventory)
    for refusal in refusals:
        click.echo(f"error: {refusal}", err=True)
    if refusals:
        sys.exit(EXIT_ERRORS)
    if trust["kind"] == "bucket" and topo.model.digest_from != "inventory" and fmt == "text":
        click.echo(f"{file}: warning: {UNPINNED}", err=True)
    return trust


@click.command("plan")
@click.argument("file", type=click.Path(dir_okay=False))
@FORMAT
@click.option(
    "--diagram",
    "diagram_out",
    type=click.Path(dir_okay=False),
    help="Also write a Graphviz diagram: out.dot, out.svg or out.png (svg/png need graphviz).",
)
@click.option(
    "--last",
    "last_file",
    type=click.Path(dir_okay=False, exists=True),
    help="The last release's record (a `status --json` report, a bench run.json or a host's "
    "`release status`): show each engine's start time and KV capacity against this topology.",
)
@click.option(
    "--inventory",
    type=click.Path(dir_okay=False, exists=True),
    help="The inventory the deploys use: show the weights' pin from its pins file "
    "(model_pins) and refuse, as a deploy would, trust_remote_code on unpinned weights and "
    "{env: VAR} secrets it does not allow (allow_env).",
)
def plan(
    file: str, fmt: str, diagram_out: str | None, last_file: str | None, inventory: str | None
) -> None:
    """Show per host the GPU map, listeners, engine commands and the P/D wiring.

    \b
    hgxserve plan topologies/h20-v4flash-4p4d.yml
    hgxserve plan topologies/h200-dsv32-2p1d.yml --format json
    hgxserve plan topologies/h200-dsv32-2p1d.yml --diagram dsv32.svg
    hgxserve plan topologies/h200-dsv32-tp8.yml --inventory inventory/lab.py

    An invalid topology is refused with the same output as `validate` (exit 1, or 2); one the
    renderer cannot write (a bug: the rules refuse every such topology) exits 6.
    """
    from hgxserve.plan.report import build_plan, last_release
    from hgxserve.render import RenderError

    result = safe_check(file)
    if result.unreadable or result.errors or result.topology is None:
        if fmt == "json":
            click.echo(json.dumps(results_json([result], False), indent=2))
        else:
            click.echo("\n".join(problems_text([result], False)))
        sys.exit(exit_code([result], False))
    topo = result.topology
    trust = _checked_trust(file, topo, inventory, fmt)
    try:
        data = build_plan(topo)
        data["trust_root"] = trust
        data["warnings"] = [p.to_json() for p in result.warnings]
        if last_file:
            data["last_release"] = last_release(topo, last_file)
        _echo_plan(data, result.warnings, fmt)
        if diagram_out:
            from hgxserve.plan.diagram import topology_dot, write_diagram

            click.echo(write_diagram(topology_dot(topo), diagram_out), err=True)
    except RenderError as exc:
        click.echo(f"{file}: error: not rendered: {exc}", err=True)
        sys.exit(exc.exit_code)
    except (OSError, ValueError) as exc:
        click.echo(f"{file}: error: {exc}", err=True)
        sys.exit(EXIT_UNREADABLE)
    except Exception as exc:  # noqa: BLE001
        click.echo(f"{file}: internal error while planning: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_UNREADABLE)
