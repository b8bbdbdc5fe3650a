"""How many labs (pytest-xdist workers, each with its own test hosts) this machine runs at once.

    python scripts/labs.py          # the number, e.g. 6
    python scripts/labs.py --why    # the number's reasons, e.g. "2 cores, 22.8 GiB available"

``HGXSERVE_LABS=N`` decides instead. Otherwise: the e2e tests mostly wait (engines starting,
health and confirm windows, SSH), so a core carries several labs (``LABS_PER_CORE``), and each
lab needs ``LAB_MEMORY_GIB`` of memory at its peak (measured: docs/testbed.md "Labs"); at most
``MAX_LABS``, at least 1.
"""

from __future__ import annotations

import os
import sys

LABS_PER_CORE = 2
LAB_MEMORY_GIB = 2.5
MAX_LABS = 8


def available_gib() -> float:
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def labs() -> tuple[int, str]:
    wanted = os.environ.get("HGXSERVE_LABS", "")
    if wanted:
        if not wanted.isdigit() or not 1 <= int(wanted) <= 32:
            sys.exit(f"HGXSERVE_LABS={wanted!r}: a number from 1 to 32")
        return int(wanted), "HGXSERVE_LABS"
    cores = os.cpu_count() or 1
    memory = available_gib()
    count = max(1, min(MAX_LABS, cores * LABS_PER_CORE, int(memory // LAB_MEMORY_GIB)))
    return count, f"{cores} cores, {memory:.1f} GiB available; HGXSERVE_LABS=N overrides"


if __name__ == "__main__":
    count, why = labs()
    print(why if sys.argv[1:] == ["--why"] else count)
