"""Release stage: render this host's units from the topology, stage them as a release, switch
all hosts together, gate the topology, then confirm everywhere or roll back everywhere.

    pyinfra inventory/testhosts.py deploys/engines.py --data topology=topologies/demo/demo-pd.yml
"""

from pyinfra import host, inventory

from hgxserve.deploying import (
    plan_switch,
    release_plans,
    require_all_reachable,
    secret_values,
    topology_from_data,
)
from hgxserve.release.plan import gate_host
from roles.agent import agent
from roles.releases import release

topology = topology_from_data(host)
active = list(inventory.iter_activated_hosts())
require_all_reachable(list(inventory), active)
plans = release_plans(topology, active, float(host.data.get("health_timeout", 900)))
coord = plan_switch(f"release:{topology.digest}", active, {n: p.id for n, p in plans.items()})
plan = plans[host.name]

agent()
release(
    plan=plan,
    secret_values=secret_values(plan),
    switch=host.name in coord.switching,
    coord=coord,
    gate=bool(coord.switching) and host.name == gate_host(topology),
    confirm_within=int(host.data.get("confirm_within", 300)),
)
