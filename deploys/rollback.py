"""Roll every host back together to its `previous` release (default) or its `baseline`.

pyinfra inventory/testhosts.py deploys/rollback.py
pyinfra inventory/testhosts.py deploys/rollback.py --data to=baseline
"""

from pyinfra import host, inventory

from hgxserve.deploying import plan_switch, require_all_reachable, rollback_targets
from hgxserve.release import CONFIRM_WITHIN_S
from hgxserve.release.ops import ReleaseState
from hgxserve.release.store import UnitSpec
from hgxserve.release.switch import SWITCH_OVERHEAD_S, start_timeout
from roles.releases import switch_to

hosts = list(inventory.iter_activated_hosts())
require_all_reachable(list(inventory), hosts)
to = str(host.data.get("to", "previous"))
targets = rollback_targets(hosts, to)
coord = plan_switch(f"rollback:{to}", hosts, targets)

state = host.get_fact(ReleaseState)
# The staged releases' engine timeouts are on the hosts: bound the slowest by the default one.
cap = host.data.get("health_timeout")
slowest = start_timeout(UnitSpec("engine", "engine"), float(cap) if cap else None)
switch_to(
    release_id=targets[host.name],
    coord=coord,
    switch=host.name in coord.switching,
    gate=bool(coord.switching) and bool(state.get(f"gate_{to}")),  # to: previous|baseline
    confirm_within=int(host.data.get("confirm_within", CONFIRM_WITHIN_S)),
    peers_within=int(SWITCH_OVERHEAD_S + slowest) + 1,
)
