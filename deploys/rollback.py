"""Roll every host back together to its `previous` release (default) or its `baseline`.

pyinfra inventory/testhosts.py deploys/rollback.py
pyinfra inventory/testhosts.py deploys/rollback.py --data to=baseline
"""

from pyinfra import host, inventory

from hgxserve.deploying import plan_switch, require_all_reachable, rollback_targets
from hgxserve.release.ops import ReleaseState
from roles.releases import switch_to

hosts = list(inventory.iter_activated_hosts())
require_all_reachable(list(inventory), hosts)
to = str(host.data.get("to", "previous"))
targets = rollback_targets(hosts, to)
coord = plan_switch(f"rollback:{to}", hosts, targets)

state = host.get_fact(ReleaseState)
switch_to(
    release_id=targets[host.name],
    coord=coord,
    switch=host.name in coord.switching,
    gate=bool(coord.switching) and bool(state.get(f"gate_{to}")),  # to: previous|baseline
    confirm_within=int(host.data.get("confirm_within", 300)),
)
