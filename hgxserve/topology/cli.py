"""`hgxserve validate` and `hgxserve plan`.

Exit codes (both commands): 0 valid, 1 errors (or warnings with --strict), 2 a file could not be
read or parsed. Problems print as `file:line:col: $.path: message`; nothing prints a traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from hgxserve.base.errors import ExitCode
from hgxserve.topology import CheckResult, check_topology
from hgxserve.topology.firewall import firewall_plan
from hgxserve.topology.model import S3Source, Topology
from hgxserve.topology.placement import proxy_tokenizer
from hgxserve.topology.ports import (
    bootstrap_address,
    engine_url,
    kv_event_endpoints,
    listeners_by_host,
    side_channel_host,
    side_channel_ports,
)
from hgxserve.topology.problems import Problem, sort_problems
from hgxserve.topology.registry import Rule

EXIT_OK, EXIT_ERRORS, EXIT_UNREADABLE = ExitCode.OK, ExitCode.FOUND, ExitCode.USAGE
UNPINNED = (
    "the weights are not pinned: they are verified against the bucket's own manifest, so "
    "whoever can write the bucket chooses them; pin them with model.digest or the inventory's "
    "pins file (model_pins)"
)


def _safe_check(path: str) -> CheckResult:
    """check_topology, with any unexpected failure turned into a problem (exit 2)."""
    try:
        return check_topology(path)
    except Exception as exc:  # noqa: BLE001  (a bug must still not print a traceback)
        message = f"internal error while checking this file: {type(exc).__name__}: {exc}"
        return CheckResult(path, None, [Problem(path, 1, 1, (), message, "internal")], True)


def _exit_code(results: Sequence[CheckResult], strict: bool) -> int:
    if any(r.unreadable for r in results):
        return EXIT_UNREADABLE
    if any(r.errors for r in results):
        return EXIT_ERRORS
    if strict and any(r.warnings for r in results):
        return EXIT_ERRORS
    return EXIT_OK


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _summary(results: Sequence[CheckResult], strict: bool) -> str:
    errors = sum(len(r.errors) for r in results)
    warnings = sum(len(r.warnings) for r in results)
    unreadable = sum(1 for r in results if r.unreadable)
    valid = sum(1 for r in results if not r.unreadable and not r.errors)
    text = (
        f"{_plural(len(results), 'file')} checked: {valid} valid, "
        f"{len(results) - valid} invalid; {_plural(errors, 'error')}, "
        f"{_plural(warnings, 'warning')}"
    )
    if unreadable:
        text += f" ({unreadable} unreadable)"
    if strict and warnings and not errors:
        text += " (--strict: warnings fail)"
    return text


def _results_json(results: Sequence[CheckResult], strict: bool) -> dict[str, Any]:
    return {
        "files": [
            {
                "file": r.file,
                "valid": not r.unreadable and not r.errors,
                "unreadable": r.unreadable,
                "errors": len(r.errors),
                "warnings": len(r.warnings),
                "problems": [p.to_json() for p in r.problems],
            }
            for r in results
        ],
        "errors": sum(len(r.errors) for r in results),
        "warnings": sum(len(r.warnings) for r in results),
        "strict": strict,
        "exit_code": _exit_code(results, strict),
    }


def _print_problems(results: Sequence[CheckResult], strict: bool) -> None:
    problems = sort_problems(p for r in results for p in r.problems)
    for problem in problems:
        click.echo(problem.text())
    click.echo(_summary(results, strict))


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def rules_markdown(rules: Sequence[Rule]) -> str:
    """The rule table of docs/topology.md: id, severity, what it checks, why."""
    lines = ["| id | severity | checks | why |", "|---|---|---|---|"]
    for r in rules:
        cells = (f"`{r.id}`", r.severity, r.summary, r.why)
        lines.append("| " + " | ".join(_markdown_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _list_rules(fmt: str) -> None:
    from hgxserve.topology.rules import RULES

    rules = sorted(RULES.values(), key=lambda r: r.id)
    if fmt == "json":
        data = [
            {"id": r.id, "severity": r.severity, "summary": r.summary, "why": r.why} for r in rules
        ]
        click.echo(json.dumps(data, indent=2))
        return
    if fmt == "markdown":
        click.echo(rules_markdown(rules))
        return
    width = max(len(r.id) for r in rules)
    for r in rules:
        click.echo(f"{r.id:<{width}}  {r.severity:<7}  {r.summary}")


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
        _list_rules(fmt)
        return
    if fmt == "markdown":
        raise click.UsageError("--format markdown lists the rules: use it with --list-rules")
    if not files:
        raise click.UsageError("give at least one topology file (or --list-rules)")
    results = [_safe_check(f) for f in files]
    if fmt == "json":
        click.echo(json.dumps(_results_json(results, strict), indent=2))
    else:
        _print_problems(results, strict)
    sys.exit(_exit_code(results, strict))


# -- plan ----------------------------------------------------------------------------------------


def _render_units(topo: Topology) -> dict[str, list[dict[str, Any]]]:
    """Units per host, from the renderer (a RenderError propagates: `plan` then fails)."""
    from hgxserve.render import render_topology

    units: dict[str, list[dict[str, Any]]] = {}
    for host, host_render in render_topology(topo).items():
        units[host] = [
            {
                "name": unit.name,
                "engine": unit.engine,
                "argv": list(unit.argv),
                "env": dict(unit.env),
            }
            for unit in host_render.units
        ]
    return units


def _model_source(topo: Topology) -> str:
    source = topo.model.source
    if isinstance(source, S3Source):
        return source.url + (f" at {source.endpoint}" if source.endpoint else "")
    if hasattr(source, "monitors"):
        return f"cephfs:{source.path}"
    return f"local:{source.path}"


def trust_plan(topo: Topology, inventory: str | None) -> tuple[dict[str, Any], list[str]]:
    """The model's trust root as plain data, and the refusals a deploy would make for it and
    for the topology's `{env: VAR}` secrets (only with the inventory, which holds the pins file
    and the allowed names)."""
    from hgxserve.topology.trust import (
        TrustError,
        env_refusals,
        inventory_trust,
        load_pins,
        trust_root,
        unpinned_refusal,
    )

    if inventory is None:
        root = trust_root(topo.model)
        data = {"kind": root.kind, "digest": root.digest, "where": root.where}
        if root.digest is None and topo.model.digest_from == "inventory":
            data["text"] = "the inventory's pins file (model_pins; give --inventory to see it)"
        return {**data, "text": data.get("text") or root.text()}, []
    from hgxserve.remote.inventory import InventoryError, load_inventory

    try:
        hosts = load_inventory(inventory).select(topo.hosts_in_use())
        pins_file, allowed = inventory_trust([h.data for h in hosts])
        root = trust_root(topo.model, load_pins(pins_file) if pins_file else {}, pins_file or "")
    except (InventoryError, TrustError) as exc:
        return {"kind": "error", "digest": None, "where": "", "text": str(exc)}, [str(exc)]
    refusals = env_refusals(topo, allowed)
    refusal = unpinned_refusal(topo, root)
    data = {"kind": root.kind, "digest": root.digest, "where": root.where, "text": root.text()}
    return data, refusals + ([refusal] if refusal else [])


def build_plan(topo: Topology) -> dict[str, Any]:
    """Everything `hgxserve plan` shows, as plain data (the JSON output).

    >>> build_plan(load_topology("topologies/h20-v4flash-4p4d.yml"))["hosts"]["h20-a"]["gpus"][0]
    ... # doctest: +SKIP
    {'index': 0, 'engine': 'prefill-0', 'role': 'prefill'}
    """
    listeners = listeners_by_host(topo)
    units = _render_units(topo)
    hosts: dict[str, Any] = {}
    for name in topo.hosts_in_use():
        host = topo.hosts[name]
        gpu_owner: dict[int, tuple[str, str]] = {}
        for engine in topo.engines_on(name):
            for gpu in engine.place[name]:
                gpu_owner.setdefault(gpu, (engine.name, engine.role))
        hosts[name] = {
            "address": host.address,
            "gpu": host.gpu,
            "gpu_count": host.gpus,
            "gpus": [
                {
                    "index": i,
                    "engine": gpu_owner[i][0] if i in gpu_owner else None,
                    "role": gpu_owner[i][1] if i in gpu_owner else None,
                }
                for i in range(host.gpus)
            ],
            "listeners": [
                {"port": li.port, "bind": li.bind, "owner": li.owner, "what": li.what}
                for li in sorted(listeners.get(name, []), key=lambda li: li.port)
            ],
            "units": units.get(name, []),
        }
    return {
        "topology": topo.name,
        "file": topo.source_file,
        "digest": topo.digest,
        "baseline": topo.baseline,
        "model": {
            "name": topo.model.name,
            "served_name": topo.model.served_name,
            "path": topo.model.path,
            "source": _model_source(topo),
            "integrity": topo.model.integrity,
        },
        "hosts": hosts,
        "wiring": _wiring(topo),
        "firewall": firewall_plan(topo),
        "fit": _fit(topo),
        # what the topology makes the hosts load on purpose (hgxserve.topology.rules.common)
        "accepted": {
            key: " ".join(str(why).split())
            for key, why in sorted((topo.raw.get("accept") or {}).items())
            if key.startswith("$")
        },
    }


def _fit(topo: Topology) -> dict[str, Any]:
    """The memory / KV-cache estimate per engine (hgxserve.topology.fit), as plain data."""
    from hgxserve.topology import fit

    try:
        facts, fits = fit.topology_fit(topo)
    except fit.ConfigError as exc:
        return {"config": topo.model.config, "error": str(exc), "engines": {}}
    if facts is None:
        return {"config": None, "error": "model.config not set: no estimate", "engines": {}}
    path = fit.config_path(topo)
    shown = os.path.relpath(path) if path and not os.path.relpath(path).startswith("..") else path
    return {
        "config": str(shown),
        "sources": facts.sources,
        "engines": {name: est.to_json() for name, est in fits.items()},
        "no_estimate": [n for n in topo.engines if n not in fits],
    }


def _engine_ref(topo: Topology, name: str) -> dict[str, Any]:
    engine = topo.engines.get(name)
    if engine is None:
        return {"name": name}
    ref: dict[str, Any] = {
        "name": name,
        "role": engine.role,
        "hosts": engine.hosts,
        "tp": engine.tp,
        "dp": engine.dp,
        "url": engine_url(topo, engine),
    }
    if engine.kv is not None:
        ref["kv"] = engine.kv.connector
        channels = [
            {
                "host": h,
                "dp_rank": rank,
                "address": side_channel_host(topo, engine, h),
                "port": port,
            }
            for h in engine.hosts
            if h in topo.hosts
            for rank, port in side_channel_ports(engine, h)
        ]
        if channels:
            ref["side_channels"] = channels
        if engine.engine == "sglang" and engine.role == "prefill":
            ref["bootstrap"] = f"{bootstrap_address(topo, engine)}:{engine.kv.bootstrap_port}"
    publishers, replays = kv_event_endpoints(topo, engine)
    if publishers:
        ref["kv_events"] = {"publishers": publishers, "replays": replays}
    return ref


def _routing(topo: Topology) -> dict[str, Any]:
    """The proxy's routing policy per route and where its tokenizer comes from."""
    proxy = topo.proxy
    assert proxy is not None
    tokenizer_dir, why = proxy_tokenizer(topo)
    return {
        "policy": proxy.routing.policy,
        "combined_policy": proxy.combined_route_policy,
        "route_policies": [proxy.route_policy(r) for r in proxy.routes],
        "tokenizer_dir": tokenizer_dir,
        "tokenizer": why,
    }


def _wiring(topo: Topology) -> dict[str, Any] | None:
    proxy = topo.proxy
    if proxy is None:
        return None
    return {
        "proxy": {
            "host": proxy.host,
            "listen": f"{proxy.listen_host}:{proxy.listen_port}",
            "kind": proxy.kind,
            "pd_min_prompt_tokens": proxy.pd_min_prompt_tokens,
            "auth": proxy.api_key is not None,
            "routing": _routing(topo) if proxy.kind == "hgxserve" else None,
        },
        "routes": [
            {
                "prefill": [_engine_ref(topo, n) for n in route.prefill],
                "decode": [_engine_ref(topo, n) for n in route.decode],
            }
            for route in proxy.routes
        ],
        "combined": [_engine_ref(topo, n) for n in proxy.combined],
    }


def _command_lines(argv: list[str], indent: str) -> list[str]:
    """argv as shell lines, one option per line, joined with backslashes."""
    groups: list[list[str]] = []
    for arg in argv:
        if arg.startswith("-") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    parts = [shlex.join(g) for g in groups]
    return [
        (indent if i == 0 else indent + "    ") + p + (" \\" if i < len(parts) - 1 else "")
        for i, p in enumerate(parts)
    ]


def _ranges(indices: list[int]) -> str:
    out: list[str] = []
    for i in sorted(indices):
        if out and out[-1].endswith(f"-{i - 1}"):
            out[-1] = out[-1].rsplit("-", 1)[0] + f"-{i}"
        elif out and out[-1] == str(i - 1):
            out[-1] = f"{i - 1}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def _plan_text(plan: dict[str, Any]) -> list[str]:
    lines = [
        f"plan for {plan['topology']} ({plan['file']})"
        + (" [baseline]" if plan["baseline"] else ""),
        f"digest {plan['digest'][:16]}",
        f"model {plan['model']['name']} served as {plan['model']['served_name']} at "
        f"{plan['model']['path']} from {plan['model']['source']}",
        f"weights trust root: {plan['trust_root']['text']}",
        "weights integrity: "
        + (
            "sha256 required (published manifest or S3 object checksums)"
            if plan["model"]["integrity"] == "sha256"
            else "OPT-OUT: files without a sha256 are accepted on size + ETag "
            "(model.integrity: size-etag)"
        ),
    ]
    for key, why in plan["accepted"].items():
        lines.append(f"ACCEPTED, loads code: {key}: {why}")
    for name, host in plan["hosts"].items():
        lines += _host_text(name, host)
    lines += _fit_text(plan["fit"])
    return lines + _wiring_text(plan["wiring"]) + _firewall_text(plan["firewall"])


def _firewall_text(wall: dict[str, Any]) -> list[str]:
    """Who may reach which port (hgxserve.topology.firewall), or why the firewall is off."""
    if not wall["enabled"]:
        return ["", f"firewall OFF: {wall['reason']}"]
    lines = ["", "firewall (table inet hgxserve; loopback always, sshd and other ports untouched)"]
    if wall.get("error"):
        return [*lines, f"  error: {wall['error']}"]
    for host, ports in wall["hosts"].items():
        lines.append(f"  {host}: {'no filtered port' if not ports else ''}".rstrip())
        for entry in ports:
            who = [f"{s['why']} {s['address']}" for s in entry["from"]]
            who += ["the controller"] if entry["controller"] else []
            lines.append(f"    {entry['port']:<6} {entry['what']} <- {', '.join(who)}")
    return [*lines, "  anyone else: dropped"]


def _host_text(name: str, host: dict[str, Any]) -> list[str]:
    lines = ["", f"host {name} ({host['address']}, {host['gpu_count']} x {host['gpu']})"]
    lines.append("  GPUs")
    runs: list[tuple[str | None, str | None, list[int]]] = []
    for gpu in host["gpus"]:
        if runs and runs[-1][0] == gpu["engine"]:
            runs[-1][2].append(gpu["index"])
        else:
            runs.append((gpu["engine"], gpu["role"], [gpu["index"]]))
    for engine, role, indices in runs:
        who = f"{engine} ({role})" if engine else "free"
        lines.append(f"    {_ranges(indices):<8} {who}")
    lines.append("  listeners")
    for li in host["listeners"]:
        lines.append(f"    {li['port']:<6} {li['bind']:<15} {li['owner']} {li['what']}")
    lines.append("  units")
    if not host["units"]:
        lines.append("    (none)")
    for unit in host["units"]:
        lines.append(f"    {unit['name']}")
        for key, value in sorted(unit["env"].items()):
            lines.append(f"      {key}={shlex.quote(str(value))}")
        lines += _command_lines(unit["argv"], "      ")
    return lines


def _wiring_text(wiring: dict[str, Any] | None) -> list[str]:
    lines = ["", "wiring"]
    if wiring is None:
        lines.append("  no proxy: clients call the engines directly")
        return lines
    proxy = wiring["proxy"]
    lines.append(
        f"  proxy {proxy['kind']} on {proxy['host']} listening {proxy['listen']}"
        + (" (api key required)" if proxy["auth"] else "")
    )
    if proxy["pd_min_prompt_tokens"]:
        lines.append(
            f"  prompts < {proxy['pd_min_prompt_tokens']} tokens -> combined; longer -> P/D"
        )
    routing = proxy.get("routing")
    if routing:
        lines.append(f"  tokenizer: {routing['tokenizer']}")
    if wiring["combined"] and routing:
        lines.append(f"  combined policy {routing['combined_policy']}")
    for ref in wiring["combined"]:
        lines.append(f"  combined {ref['name']} {ref.get('url', '?')}")
        lines += _kv_events_text(ref)
    for index, route in enumerate(wiring["routes"]):
        policy = f" policy {routing['route_policies'][index]}" if routing else ""
        lines.append(f"  route {index}{policy}")
        for side in ("prefill", "decode"):
            for ref in route[side]:
                lines += _route_ref_text(side, ref)
        lines.append(
            "    flow: proxy -> prefill (max_tokens=1, kv_transfer_params) -> decode "
            "(KV pulled from the prefill's side channel) -> client"
        )
    return lines


def _route_ref_text(side: str, ref: dict[str, Any]) -> list[str]:
    where = ",".join(ref.get("hosts", []))
    shape = f"tp {ref.get('tp')}" + (f" dp {ref['dp']}" if ref.get("dp", 1) > 1 else "")
    lines = [
        f"    {side:<7} {ref['name']} on {where} ({shape}) {ref.get('url', '?')}"
        + (f" kv {ref['kv']}" if "kv" in ref else "")
    ]
    for ch in ref.get("side_channels", []):
        lines.append(
            f"              side channel dp{ch['dp_rank']} "
            f"{ch['address']}:{ch['port']} ({ch['host']})"
        )
    if "bootstrap" in ref:
        lines.append(f"              bootstrap {ref['bootstrap']}")
    return lines + _kv_events_text(ref)


def _kv_events_text(ref: dict[str, Any]) -> list[str]:
    events = ref.get("kv_events")
    if not events:
        return []
    pairs = zip(events["publishers"], events["replays"], strict=True)
    return [
        f"              kv events dp{rank} {pub} (replay {rep})"
        for rank, (pub, rep) in enumerate(pairs)
    ]


def _fit_text(data: dict[str, Any]) -> list[str]:
    lines = ["", "fit (estimate per GPU, GiB; docs/fit.md)"]
    if data.get("error"):
        return [*lines, f"  {data['error']}"]
    lines.append(f"  model config {data['config']}")
    header = (
        f"  {'engine':<12} {'gpu':<6} {'util':>5} {'budget':>7} {'weights':>8} {'other':>6} "
        f"{'kv':>6} {'kv/token':>9} {'kv tokens':>10} {'seqs@max_len':>13} {'max_num_seqs':>12}  "
        "status"
    )
    lines.append(header)
    gib = 1 << 30
    for name, est in data["engines"].items():
        conc = est["max_concurrency"]
        per_rank = f"{conc:.1f}" if conc is not None else "-"
        if est["dp_ranks"] > 1:
            per_rank += f" x{est['dp_ranks']}"
        util = f"{est['utilization']:.2f}" + ("*" if est["utilization_assumed"] else "")
        kv = "fixed" if est["kv_fixed"] else f"{est['kv_bytes'] / gib:.1f}"
        lines.append(
            f"  {name:<12} {est['gpu']:<6} {util:>5} {est['budget'] / gib:>7.1f} "
            f"{est['weights'] / gib:>8.1f} {est['allowance'] / gib:>6.1f} {kv:>6} "
            f"{est['kv_bytes_per_token']:>9} {est['kv_tokens']:>10} {per_rank:>13} "
            f"{est['max_num_seqs']:>12}  {est['status']}"
        )
        lines.extend(_fit_terms_text(est))
        for shape in est["shapes"]:
            mark = "ok" if shape["concurrency"] <= shape["capacity"] else "does not fit"
            lines.append(
                f"      warm-up {shape['input']}+{shape['output']} tokens x "
                f"{shape['concurrency']}: KV holds {shape['capacity']} ({mark})"
            )
    if any(e["utilization_assumed"] for e in data["engines"].values()):
        lines.append("  * SGLang picks its memory fraction when unset; vLLM's 0.9 assumed")
    if data.get("no_estimate"):
        lines.append(f"  no estimate (GPU memory unknown): {', '.join(data['no_estimate'])}")
    return lines


def _fit_terms_text(est: dict[str, Any]) -> list[str]:
    """The `other` column term by term (fit.allowance_terms), and what lies outside it."""
    terms = est.get("terms") or {}
    if not terms:
        return []
    gib = 1 << 30
    ws = max(
        ("moe_workspace", "MoE"),
        ("dsa_indexer", "DSA indexer"),
        ("dsa_sparse", "FlashMLA-sparse"),
        key=lambda item: terms.get(item[0], 0),
    )
    peak = "sampler" if terms["sampler"] >= terms["forward"] else "forward"
    lines = [
        f"      other: workspace {terms['workspace'] / gib:.1f} ({ws[1]}) + activations "
        f"{terms['activations'] / gib:.1f} ({peak}) + non-torch {terms['non_torch'] / gib:.1f}"
    ]
    if "headroom" in terms:
        lines.append(
            f"      outside the budget: CUDA context {terms['context'] / gib:.1f}, "
            f"{terms['headroom'] / gib:.1f} left for CUDA graphs and run-time buffers"
        )
    if "indexer_logits" in terms:
        lines.append(
            f"      not profiled: DSA indexer logits of one prefill chunk at max_model_len "
            f"{terms['indexer_logits'] / gib:.1f}"
        )
    if est.get("seed_failure"):
        lines.append(f"      {est['seed_failure']}: the estimate does not explain it")
    return lines


def _last_release(topo: Topology, path: str) -> dict[str, Any]:
    """The engines' numbers kept by the last release (docs/releases.md "The engines' own
    numbers"), checked against this topology's shapes and fit estimate."""
    from hgxserve.bench.scenario import kv_shapes
    from hgxserve.release.kvcap import last_release

    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a status report, bench run or release status")
    return {"from": path, "engines": last_release(topo, doc, kv_shapes(topo.source_file))}


def _echo_plan(data: dict[str, Any], warnings: Sequence[Any], fmt: str) -> None:
    """The plan as JSON, or as text (warnings on stderr, then the last release's numbers)."""
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
        return
    for problem in warnings:
        click.echo(problem.text(), err=True)
    click.echo("\n".join(_plan_text(data)))
    last = data.get("last_release")
    if last is not None:
        from hgxserve.release.kvcap import last_release_lines

        click.echo("\n".join(last_release_lines(last["from"], last["engines"])))


def _checked_trust(file: str, topo: Topology, inventory: str | None, fmt: str) -> dict[str, Any]:
    """The trust root for the plan; the deploy's refusals exit 1 (on stderr), an unpinned
    model is a warning."""
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
    from hgxserve.render import RenderError

    result = _safe_check(file)
    if result.unreadable or result.errors or result.topology is None:
        if fmt == "json":
            click.echo(json.dumps(_results_json([result], False), indent=2))
        else:
            _print_problems([result], False)
        sys.exit(_exit_code([result], False))
    topo = result.topology
    trust = _checked_trust(file, topo, inventory, fmt)
    try:
        data = build_plan(topo)
        data["trust_root"] = trust
        data["warnings"] = [p.to_json() for p in result.warnings]
        if last_file:
            data["last_release"] = _last_release(topo, last_file)
        _echo_plan(data, result.warnings, fmt)
        if diagram_out:
            from hgxserve.topology.diagram import topology_dot, write_diagram

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
