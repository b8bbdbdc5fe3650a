"""The fabric preflight's steps (python.call functions run by the controller, each on every host
it concerns before the next): read the rails' links, start the ib_write_bw servers, measure
from the clients (one host at a time, so measurements do not share links), then the verdict on
every host of the switch, which keeps the figures in the release's record and stops the release
before any unit changes when something falls short (`gate.fabric: fail`).

What is measured and judged is hgxserve.release.fabric."""

from __future__ import annotations

import json
import shlex

from pyinfra.api.host import Host
from pyinfra.api.state import State

from hgxserve.parsers.fabric import (
    parse_all_reduce_perf,
    parse_ib_write_bw,
    parse_port_lines,
    port_rate_gbps,
)
from hgxserve.parsers.sections import split_sections
from hgxserve.release.fabric import (
    RECORD,
    FabricRun,
    allreduce_command,
    allreduce_measurement,
    client_command,
    expected_rail_gbps,
    links_command,
    measurement,
    server_command,
)


def fabric_links(state: State, host: Host, run: FabricRun, sysfs: str) -> bool:
    """python.call: this host's rails' state, rate, link layer and GID, read from sysfs."""
    rails = run.scope.rails[host.name]
    ok, output = host.run_shell_command(links_command(sysfs, rails))
    if not ok:
        host.log_styled(f"fabric: the RDMA ports under {sysfs} could not be read", fg="red")
        return True  # judged (and said) by the verdict step
    readings = parse_port_lines(output.stdout_lines)
    run.links[host.name] = readings
    for key in sorted(readings):
        r = readings[key]
        host.log_styled(f"fabric: {key} {r.state} {r.rate} {r.link_layer} GID {r.gid}")
    return True


def fabric_serve(state: State, host: Host, run: FabricRun) -> bool:
    """python.call: start this host's ib_write_bw servers in the background (bounded)."""
    servers = run.scope.servers(host.name)
    command = server_command(servers, run.roce(host.name), len(run.scope.runs()))
    ok, output = host.run_shell_command(command)
    if not ok:
        detail = " ".join(output.stderr_lines) or "no output"
        host.log_styled(f"fabric: the ib_write_bw servers did not start: {detail}", fg="red")
    return True


def _rail_rate(run: FabricRun, host: str, rail: str) -> float | None:
    """`host`'s expected rate for `rail`: its GPU kind's, else its port's own."""
    ports = [r for r in run.links.get(host, {}).values() if r.device == rail]
    rate = port_rate_gbps(ports[0].rate) if ports else None
    return expected_rail_gbps(run.scope.gpus[host], rate)


def fabric_measure(state: State, host: Host, run: FabricRun, addresses: dict[str, str]) -> bool:
    """python.call (one host at a time): ib_write_bw from this host to each server host."""
    roce = run.roce(host.name)
    for pair, port, rail in run.scope.clients(host.name):
        command = client_command(rail, port, addresses[pair.server], roce.get(rail, False))
        _, output = host.run_shell_command(command)
        section = split_sections(["##run", *output.stdout_lines])["run"]
        lines = [line for line in section["lines"] if line.strip()]
        report = parse_ib_write_bw(lines)
        failure = f"rc {section['rc']}: {lines[-1].strip() if lines else 'no output'}"
        rates = (_rail_rate(run, pair.client, rail), _rail_rate(run, pair.server, rail))
        result = measurement(pair, rail, report, rates, failure)
        run.bandwidth.append(result)
        said = result.get("shortfall") or (
            f"ib_write_bw {pair.client} -> {pair.server} rail {rail}: "
            f"{result['average_gbps']:g} Gb/s average (floor {result['floor_gbps'] or '-'} Gb/s)"
        )
        host.log_styled(f"fabric: {said}", fg="red" if "shortfall" in result else "blue")
    return True


def fabric_allreduce(
    state: State, host: Host, run: FabricRun, mpirun: str, addresses: dict[str, str]
) -> bool:
    """python.call on each multi-host engine's head: nccl-tests' all_reduce_perf across the
    engine's hosts, launched by `mpirun` (after the point-to-point runs, one at a time)."""
    for span in run.scope.spans:
        if span.hosts[0] != host.name:
            continue
        roce = any(run.roce(host.name).get(rail, False) for rail in span.rails)
        _, output = host.run_shell_command(allreduce_command(mpirun, span, addresses, roce))
        section = split_sections(["##run", *output.stdout_lines])["run"]
        lines = [line for line in section["lines"] if line.strip()]
        failure = f"rc {section['rc']}: {lines[-1].strip() if lines else 'no output'}"
        rails = {
            h: sum(_rail_rate(run, h, rail) or 0.0 for rail in span.rails) or None
            for h in span.hosts
        }
        result = allreduce_measurement(span, parse_all_reduce_perf(lines), rails, failure)
        run.allreduce.append(result)
        said = result.get("shortfall") or (
            f"NCCL all-reduce of {span.engine} across {'+'.join(span.hosts)}: "
            f"{result['avg_busbw_gbytes']:g} GB/s bus bandwidth "
            f"(floor {result['floor_gbytes'] or '-'} GB/s)"
        )
        host.log_styled(f"fabric: {said}", fg="red" if "shortfall" in result else "blue")
    return True


def _keep_record(host: Host, run: FabricRun, release_id: str, root: str) -> None:
    """releases/<id>/fabric.json on this host (written whole, then renamed)."""
    path = f"{root}/releases/{release_id}/{RECORD}"
    text = json.dumps(run.record(host.name), indent=2, sort_keys=True)
    q_path, q_tmp = shlex.quote(path), shlex.quote(f"{path}.partial")
    ok, output = host.run_shell_command(
        f"printf '%s\\n' {shlex.quote(text)} > {q_tmp} && mv {q_tmp} {q_path}"
    )
    if not ok:
        host.log_styled(f"fabric: {path} not written: {' '.join(output.stderr_lines)}", fg="red")


def fabric_verdict(state: State, host: Host, run: FabricRun, release_id: str, root: str) -> bool:
    """python.call on every host of the switch: keep the figures with the release, say the
    verdict, and (`gate.fabric: fail`) stop every host before any unit changes."""
    shortfalls = run.judge()
    if host.name in run.scope.rails:
        _keep_record(host, run, release_id, root)
    if not shortfalls:
        figures = "; ".join(
            [
                f"{m['client']}->{m['server']} {m['rail']} {m['average_gbps']:g} Gb/s"
                for m in run.bandwidth
            ]
            + [f"{m['engine']} all-reduce {m['avg_busbw_gbytes']:g} GB/s" for m in run.allreduce]
        )
        host.log_styled(f"fabric preflight passed: {figures or 'links only'}", fg="green")
        return True
    loud = "red" if run.policy == "fail" else "yellow"
    for line in shortfalls:
        host.log_styled(f"FABRIC SHORT: {line}", fg=loud)
    if run.policy != "fail":
        host.log_styled("fabric preflight fell short; going on (gate.fabric: warn)", fg="yellow")
        return True
    host.log_styled(
        f"fabric preflight failed ({len(shortfalls)} shortfall(s)): release {release_id} "
        "stopped before any unit changed on any host (gate.fabric: fail)",
        fg="red",
    )
    return False
