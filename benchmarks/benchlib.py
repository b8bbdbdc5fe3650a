"""What the benchmarks share: free ports, readiness waits, percentiles, an earlier revision.

from benchlib import baseline_command, free_port, pct, wait_http
cmd = baseline_command("/tmp/base") + ["proxy", "serve", "--config", "p.json"]
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request

# Runs `hgxserve` from another source tree (an earlier revision unpacked with git archive),
# not the editable install of this checkout.
_BASELINE_MAIN = (
    "import sys; tree = sys.argv.pop(1); sys.path.insert(0, tree); "
    "sys.meta_path[:] = [f for f in sys.meta_path "
    "if not getattr(f, '__module__', '').startswith('__editable__')]; "
    "import hgxserve; assert hgxserve.__file__.startswith(tree), hgxserve.__file__; "
    "from hgxserve.cli import main; sys.argv[0] = 'hgxserve'; sys.exit(main())"
)


def baseline_command(tree: str) -> list[str]:
    """argv prefix that runs `hgxserve` from the source tree `tree`."""
    return [sys.executable, "-c", _BASELINE_MAIN, os.path.abspath(tree)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 30) -> None:
    """Until GET `url` answers 200; SystemExit after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"not ready: {url}")


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
