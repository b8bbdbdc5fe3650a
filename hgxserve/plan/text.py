"""`hgxserve plan`'s text: the plan's data (`hgxserve.plan.report.build_plan`) as lines, per
host the GPU map, listeners and each unit's environment and command, then the fit estimate,
the wiring and the firewall.

    print("\n".join(plan_text(data)))
"""

from __future__ import annotations

import shlex
from typing import Any


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


def plan_text(plan: dict[str, Any]) -> list[str]:
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
