#!/usr/bin/python3
"""Simulated ``ibv_devinfo`` for hgxserve test hosts: prints a real capture from an H200 node.

Installed as /usr/local/bin/ibv_devinfo. Host kind h200 prints the whole capture; kind h20
(no complete H20 capture exists) prints the capture's blocks for the NICs that the H20-3e
``nvidia-smi topo -m`` capture names in its NIC Legend (mlx5_0, mlx5_1).

Example::

    ibv_devinfo -d mlx5_0
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "/usr/local/lib/hgxserve-testbed")

from nvidia_smi import KINDS, FakeError, gpu_kind, read_fixture  # noqa: E402

CAPTURE = "h200_ibv_devinfo.txt"


def blocks(kind: str) -> list[list[str]]:
    """Return the capture's hca blocks (each without its trailing blank line) for ``kind``."""
    found: list[list[str]] = []
    for line in read_fixture(CAPTURE):
        if line.startswith("hca_id:"):
            found.append([line])
        elif found and line.strip():
            found[-1].append(line)
    if kind == "h200":
        return found
    legend = read_fixture(KINDS[kind]["topo"])
    nics = {m.group(1) for m in map(re.compile(r"^\s+NIC\d+: (\S+)$").match, legend) if m}
    return [block for block in found if block[0].split()[1] in nics]


def main(argv: list[str]) -> str:
    """Return what ibv_devinfo prints for ``argv``; raise FakeError for other invocations."""
    found = blocks(gpu_kind())
    if argv == ["-l"]:
        names = "".join(f"\t{block[0].split()[1]}\n" for block in found)
        return f"{len(found)} HCAs found:\n{names}"
    if len(argv) == 2 and argv[0] in ("-d", "--ib-dev"):
        found = [block for block in found if block[0].split()[1] == argv[1]]
        if not found:
            raise FakeError(f"IB device '{argv[1]}' wasn't found")
    elif argv:
        raise FakeError("this simulated ibv_devinfo supports only: (no arguments), -l, -d DEVICE")
    return "\n".join("\n".join(block) + "\n" for block in found)


if __name__ == "__main__":
    try:
        sys.stdout.write(main(sys.argv[1:]))
    except FakeError as exc:
        print(f"ibv_devinfo (hgxserve test host simulation): {exc}", file=sys.stderr)
        sys.exit(1)
