"""Command line of the test-host harness: ``python -m testbed [--lab L] up|down|status|ssh|exec``.

Example::

    python -m testbed up --hosts 3 --gpu h200,h20,h20
    python -m testbed up --hosts 2 --image bookworm,trixie
    python -m testbed ssh hgx-a -- nvidia-smi -L
    python -m testbed down
    python -m testbed labs                              # the labs on this machine
    python -m testbed --lab 2 status                    # lab 2's hosts (testbed/lab.py)
    python -m testbed --lab 2 exec -- curl -s http://10.77.0.11:8000/health
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from testbed import lab, rootfs
from testbed.util import TestbedError

# testbed.hosts reads the lab's state directory when imported: imported once the lab is entered
hosts: Any = None


def _print_status(as_json: bool) -> int:
    rows = hosts.status()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0 if rows and all(r["running"] for r in rows) else 1
    if not rows:
        print("no test hosts are up")
        return 1
    head = ("NAME", "ADDRESS", "GPU", "IMAGE", "PID", "RUNNING", "SSHD", "SYSTEMD", "RAM")
    print("{:8} {:12} {:5} {:9} {:>8} {:8} {:5} {:10} {}".format(*head))
    for r in rows:
        ram = f"{r['ram_mib']:.0f} MiB" if r["ram_mib"] is not None else "-"
        print(
            f"{r['name']:8} {r['address']:12} {r['gpu']:5} {r['image']:9} {r['pid'] or '-':>8} "
            f"{'yes' if r['running'] else 'NO':8} {'yes' if r['sshd'] else 'no':5} "
            f"{r['systemd'] or '-':10} {ram}"
        )
    bed = hosts.load()
    if bed:
        print(f"state: {bed.state_file}  ssh key: {bed.ssh_key}")
    return 0 if all(r["running"] for r in rows) else 1


def _print_labs() -> int:
    root = lab.base_dir() / "labs"
    found = sorted(
        (int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())
        if root.is_dir()
        else []
    )
    print(f"{'LAB':4} {'NETNS':9} {'HOSTS':6} {'HELD BY':8} STATE DIR")
    for index in [0, *found]:
        state = lab.state_dir(index) / "state.json"
        count = len(json.loads(state.read_text()).get("hosts", [])) if state.is_file() else 0
        holder = lab.holder(index) if index else None
        netns = lab.netns(index) or "(machine)"
        print(f"{index:<4} {netns:9} {count:<6} {holder or '-':8} {lab.state_dir(index)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    global hosts
    parser = argparse.ArgumentParser(
        prog="python -m testbed", description="Real systemd-nspawn test hosts for hgxserve."
    )
    parser.add_argument(
        "--lab",
        type=int,
        default=None,
        help="work in lab L (testbed/lab.py: its own network namespace hgxlab<L> and state "
        "directory; default $HGXSERVE_LAB, else 0, the machine's own namespace)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="boot N test hosts (reuses running ones that match)")
    p_up.add_argument("--hosts", type=int, default=3, help="number of hosts (default 3)")
    p_up.add_argument(
        "--gpu",
        default="h200",
        help="simulated GPU kind: h200 or h20, one for all hosts or one per host (h200,h20,h20)",
    )
    p_up.add_argument(
        "--image",
        default=rootfs.SUITE,
        help=f"Debian suite of the root filesystem: {', '.join(rootfs.SUITES)} (Python "
        f"{', '.join(rootfs.SUITES.values())}), one for all hosts or one per host "
        "(bookworm,trixie)",
    )
    p_down = sub.add_parser("down", help="stop and remove everything `up` started")
    p_down.add_argument(
        "--force", action="store_true", help="tear down even while test sessions hold a lease"
    )
    p_status = sub.add_parser("status", help="show the hosts and whether they are up")
    p_status.add_argument("--json", action="store_true", help="print JSON")
    p_ssh = sub.add_parser("ssh", help="run a command on a host as root: ssh NAME -- CMD...")
    p_ssh.add_argument("name")
    p_ssh.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("labs", help="list the labs on this machine and which process holds each")
    p_exec = sub.add_parser(
        "exec", help="run a command on the controller side of the lab: exec -- CMD..."
    )
    p_exec.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "labs":
            return _print_labs()
        index = lab.current() if args.lab is None else args.lab
        if not 0 <= index <= lab.MAX_LABS:
            raise TestbedError(f"--lab must be between 0 and {lab.MAX_LABS}")
        if index or args.lab is not None:
            lab.enter(index)
        from testbed import hosts as testbed_hosts

        hosts = testbed_hosts
        if args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise TestbedError("exec needs a command: exec -- CMD...")
            os.execvp(cmd[0], cmd)
        if args.command == "up":
            bed = hosts.up(args.hosts, args.gpu, args.image)
            for host in bed.hosts:
                print(f"{host.name}\t{host.address}\t{host.gpu}\t{host.image}")
            return 0
        if args.command == "down":
            if not hosts.down(force=args.force):
                print("no test hosts were recorded; removed leftovers under our names, if any")
            return 0
        if args.command == "status":
            return _print_status(args.json)
        if args.command == "ssh":
            bed = hosts.require()
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            argv_ssh = bed.ssh_argv(args.name, " ".join(cmd) if cmd else "")
            if not cmd:
                argv_ssh.insert(1, "-t")
            os.execvp(argv_ssh[0], argv_ssh)
    except TestbedError as exc:
        print(f"testbed: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
