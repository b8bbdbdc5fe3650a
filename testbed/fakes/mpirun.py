#!/usr/bin/python3
"""Simulated Open MPI ``mpirun`` for hgxserve test hosts: starts one process per ``-H`` host
slot, this host's locally and the others' over SSH (as Open MPI's launcher does, which needs
SSH between the hosts), and hands each its rank, the job's size and rank 0's address
(HGXSERVE_SIM_MPI_RANK / _SIZE / _ROOT) instead of PMIx. ``-x NAME=VALUE`` exports reach every
process. Rank 0's output is printed; when a process fails, Open MPI's abort text follows (as
captured in fixtures/real/h20_error-802_nccl-tests.txt) and the exit status is 1.

Example::

    mpirun --allow-run-as-root -np 2 -H 10.77.0.12:1,10.77.0.13:1 -x NCCL_IB_HCA=mlx5_0 \\
        all_reduce_perf -b 256M -e 256M -g 4
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys

ROOT_PORT = 18600
ABORT = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[58461,1],{rank}]
  Exit code:    {code}
--------------------------------------------------------------------------
"""


def _args(argv: list[str]) -> tuple[int, list[str], list[str], list[str]]:
    """(np, host slots, NAME=VALUE exports, the program and its arguments)."""
    np, hosts, env = 1, [], []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag == "--allow-run-as-root":
            i += 1
            continue
        if flag not in ("-np", "-H", "-x") or i + 1 >= len(argv):
            sys.exit(f"mpirun (hgxserve test host simulation): does not take {flag}")
        value = argv[i + 1]
        if flag == "-np":
            np = int(value)
        elif flag == "-H":
            for slot in value.split(","):
                host, _, count = slot.partition(":")
                hosts += [host] * int(count or 1)
        else:
            env.append(value)
        i += 2
    return np, hosts[:np], env, argv[i:]


def _local(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def main(argv: list[str]) -> int:
    np, hosts, env, program = _args(argv)
    if len(hosts) < np or not program:
        sys.exit("mpirun (hgxserve test host simulation): -H names fewer slots than -np")
    procs = []
    for rank, host in enumerate(hosts):
        ours = [
            f"HGXSERVE_SIM_MPI_RANK={rank}",
            f"HGXSERVE_SIM_MPI_SIZE={np}",
            f"HGXSERVE_SIM_MPI_ROOT={hosts[0]}:{ROOT_PORT}",
        ]
        command = ["env", *env, *ours, *program]
        if not _local(host):
            remote = " ".join(shlex.quote(word) for word in command)
            command = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                       f"root@{host}", remote]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate()[0] for p in procs]
    sys.stdout.write(outputs[0])
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode]
    if failed:
        sys.stdout.write(ABORT.format(rank=failed[0][0], code=failed[0][1]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
