"""promtool's checks of a rendered monitoring tree (`monitoring render --check`).

for cmd, proc in promtool_checks(Path("build/monitoring")):
    print(cmd, proc.returncode)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

PROMTOOL = "promtool"


def promtool_checks(out: Path) -> list[tuple[list[str], subprocess.CompletedProcess[str]]]:
    """`promtool check config` on the whole config (it checks the rule files it names too),
    then `promtool check rules` on each rule file; run in `out/prometheus`."""
    prom = out / "prometheus"
    commands = [[PROMTOOL, "check", "config", "prometheus.yml"]]
    commands += [
        [PROMTOOL, "check", "rules", str(p.relative_to(prom))]
        for p in sorted(prom.glob("hgxserve/rules/*.yml"))
    ]
    return [
        (cmd, subprocess.run(cmd, cwd=prom, capture_output=True, text=True, check=False))
        for cmd in commands
    ]
