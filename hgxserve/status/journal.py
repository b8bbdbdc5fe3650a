"""What `hgxserve logs` runs on each host: journalctl of a unit (or of several, merged by time).

journal_argv("hgxserve-decode-0.service", 200, None, False)
# ['journalctl', '-u', 'hgxserve-decode-0.service', '--no-pager', '-o', 'short-iso', ...]
"""

from __future__ import annotations


def journal_argv(
    unit: str | list[str], lines: int | None, since: str | None, follow: bool
) -> list[str]:
    """journalctl of `unit` (or of several units, merged by time)."""
    units = [unit] if isinstance(unit, str) else unit
    argv = ["journalctl", *(w for u in units for w in ("-u", u))]
    argv += ["--no-pager", "-o", "short-iso", "--no-hostname"]
    if lines is not None:
        argv += ["-n", str(lines)]
    if since is not None:
        argv += ["--since", since]
    if follow:
        argv.append("-f")
    return argv
