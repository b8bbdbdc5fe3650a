"""pyinfra inventory of the local test hosts, read from the test-host harness's state file.

Bring the hosts up first (``python -m testbed up``), then::

    pyinfra inventory/testhosts.py exec -- systemctl is-system-running

Groups: ``testhosts`` (all hosts), ``h200`` / ``h20`` (by simulated GPU kind), ``bookworm`` /
``trixie`` (by image). Host data keys: ``ssh_hostname``, ``ssh_user``, ``ssh_key``,
``ssh_known_hosts_file``, ``ssh_strict_host_key_checking`` (how to reach the host),
``testbed_gpu`` (the simulated GPU kind, ``h200`` or ``h20``), ``testbed_image`` (the Debian
suite the host booted, ``bookworm`` or ``trixie``: ``python -m testbed up --image``),
``model_pins``: the demo model's pin (the pins file testbed/demo.py writes when it publishes the
model, when there is one), ``runtime_find_links`` / ``runtime_no_index``: the runtime stage
builds its wheelhouse only from the simulated engine wheels the harness builds
($HGXSERVE_TESTBED_DIR/wheels), never from an index; ``rdma_sysfs``: where the release's RDMA
evidence reads port counters (the hosts' SIMULATED counters, not /sys/class/infiniband). The
state file is $HGXSERVE_TESTBED_DIR/state.json (default /var/lib/hgxserve-testbed/state.json).
"""

import json
import os
from pathlib import Path

_STATE = Path(os.environ.get("HGXSERVE_TESTBED_DIR", "/var/lib/hgxserve-testbed")) / "state.json"
# the demo model's manifest digest, pinned outside the bucket (testbed/demo.py PINS)
_PINS = _STATE.parent / "demo-pins.yml"


def _hosts() -> list[tuple[str, dict[str, object]]]:
    if not _STATE.is_file():
        raise SystemExit(
            f"inventory/testhosts.py: no test hosts recorded ({_STATE} is missing); "
            "run `python -m testbed up` first"
        )
    state = json.loads(_STATE.read_text())
    return [
        (
            host["name"],
            {
                "ssh_hostname": host["address"],
                "ssh_user": "root",
                "ssh_key": state["ssh_key"],
                # Test hosts get fresh host keys at every boot; nothing to pin.
                "ssh_known_hosts_file": "/dev/null",
                "ssh_strict_host_key_checking": "no",
                "testbed_gpu": host["gpu"],
                "testbed_image": host.get("image", "bookworm"),
                "runtime_find_links": str(_STATE.parent / "wheels"),
                "runtime_no_index": True,
                # simulated RDMA port counters (testbed/hosts.py SIM_RDMA_DIR)
                "rdma_sysfs": "/var/lib/hgxserve-sim/infiniband",
                **({"model_pins": str(_PINS)} if _PINS.is_file() else {}),
            },
        )
        for host in state["hosts"]
    ]


testhosts = _hosts()
h200 = [entry for entry in testhosts if entry[1]["testbed_gpu"] == "h200"]
h20 = [entry for entry in testhosts if entry[1]["testbed_gpu"] == "h20"]
bookworm = [entry for entry in testhosts if entry[1]["testbed_image"] == "bookworm"]
trixie = [entry for entry in testhosts if entry[1]["testbed_image"] == "trixie"]
