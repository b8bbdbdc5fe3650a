"""Roll every host back together to its `previous` release (default) or its `baseline`.

pyinfra inventory/testhosts.py deploys/rollback.py
pyinfra inventory/testhosts.py deploys/rollback.py --data to=baseline
"""

from pyinfra import host, inventory

from hgxserve.release.deploying import require_all_reachable, rollback_targets
from hgxserve.release.ops import ReleaseState, coordination
from roles.releases import switch_to

hosts = list(inventory.iter_activated_hosts())
require_all_reachable(list(inventory), hosts)
to = str(host.data.get("to", "previous"))
targets = rollback_targets(hosts, to)
coord = coordination(f"rollback:{to}:{sorted(targets.items())}")
if not coord.planned:
    coord.targets = targets
    for h in hosts:
        state = h.get_fact(ReleaseState)
        if state.get("current") != targets[h.name] or state.get("pending"):
            coord.switching[h.name] = targets[h.name]
    coord.planned = True

state = host.get_fact(ReleaseState)
link = "previous" if to == "previous" else "baseline"
switch_to(
    release_id=targets[host.name],
    coord=coord,
    switch=host.name in coord.switching,
    gate=bool(coord.switching) and bool(state.get(f"gate_{link}")),
    confirm_within=int(host.data.get("confirm_within", 300)),
)
