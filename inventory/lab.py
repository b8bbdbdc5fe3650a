"""pyinfra inventory built from a YAML host list (inventory/lab.yml, or $HGXSERVE_INVENTORY).

    pyinfra inventory/lab.py deploys/site.py --data topology=topologies/h20-v4flash-tp8.yml
    pyinfra inventory/lab.py --limit h20-a deploys/preflight.py --data topology=...

YAML: `defaults:` (ssh_user, ssh_key, ssh_port) and `hosts: {name: {address, ssh_*...}}`.
Host names must be the topology's host names; each host lands in the group `lab`.
Optional, for every host: `model_pins:` the pins file of the weights' manifest digests (relative
to the YAML file; docs/weights.md "Trust root") and `allow_env:` the controller environment
variables `{env: VAR}` secrets may push to the hosts (docs/security.md).
"""

import os
from pathlib import Path

from ruamel.yaml import YAML

_FILE = Path(os.environ.get("HGXSERVE_INVENTORY", Path(__file__).with_name("lab.yml")))


def _hosts() -> list[tuple[str, dict[str, object]]]:
    data = YAML(typ="safe").load(_FILE.read_text()) or {}
    defaults = data.get("defaults", {})
    trust: dict[str, object] = {}
    if data.get("model_pins"):
        trust["model_pins"] = str(_FILE.parent / os.path.expanduser(str(data["model_pins"])))
    if data.get("allow_env"):
        trust["allow_env"] = [str(name) for name in data["allow_env"]]
    out = []
    for name, spec in (data.get("hosts") or {}).items():
        spec = {**defaults, **(spec or {})}
        host_data: dict[str, object] = {"ssh_hostname": spec.pop("address"), **trust}
        for key, value in spec.items():
            host_data[key if key.startswith("ssh_") else f"lab_{key}"] = (
                os.path.expanduser(value) if key == "ssh_key" else value
            )
        out.append((name, host_data))
    return out


lab = _hosts()
