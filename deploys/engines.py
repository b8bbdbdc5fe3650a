"""Release stage: render this host's units from the topology, stage them as a release, switch
all hosts together, gate the topology, then confirm everywhere or roll back everywhere.

    pyinfra inventory/testhosts.py deploys/engines.py --data topology=topologies/demo/demo-pd.yml
"""

from pyinfra import host, inventory

from hgxserve.bench.releasegate import bench_step_for
from hgxserve.deploying import (
    plan_switch,
    release_plans,
    require_all_reachable,
    secret_values,
    topology_from_data,
)
from hgxserve.release import CONFIRM_WITHIN_S
from hgxserve.release.evidence import RDMA_SYSFS, rdma_roles, unchecked_transport
from hgxserve.release.plan import gate_host, switch_bound_s
from hgxserve.release.switch import SWITCH_OVERHEAD_S
from hgxserve.topology.placement import pin_digest
from roles.agent import agent
from roles.releases import release

# a pinned weights digest (`--data weights_digest=`, as for the weights stage) reaches the units
topology = pin_digest(topology_from_data(host), host.data.get("weights_digest"))
active = list(inventory.iter_activated_hosts())
require_all_reachable(list(inventory), active)
cap = host.data.get("health_timeout")  # seconds; default: each engine's start_timeout_s
plans = release_plans(topology, active, float(cap) if cap else None)
coord = plan_switch(f"release:{topology.digest}", active, {n: p.id for n, p in plans.items()})
plan = plans[host.name]
coord.rdma_roles = rdma_roles(topology)
# gate.rdma: off: what carried cross-host KV instead (TCP), said when the release is confirmed
coord.rdma_note = None if coord.rdma_roles else unchecked_transport(topology)
rdma_root = str(host.data.get("rdma_sysfs", RDMA_SYSFS))
devices = list(topology.hosts[host.name].rdma) if host.name in topology.hosts else []

is_gate_host = host.name == gate_host(topology)
bench = topology.gate.bench
# the SLA bench (`gate.bench:`) runs on the controller; --data bench_tokenizer=DIR is the
# model's tokenizer there (default: AIPerf's built-in encoding, which needs its cache offline)
step = (
    bench_step_for(topology, topology.source_file, active, host.data.get("bench_tokenizer"))
    if bench is not None and is_gate_host
    else None
)

agent()
release(
    plan=plan,
    secret_values=secret_values(plan),
    switch=host.name in coord.switching,
    coord=coord,
    gate=bool(coord.switching) and is_gate_host,
    confirm_within=int(host.data.get("confirm_within", CONFIRM_WITHIN_S)),
    peers_within=switch_bound_s(plans, SWITCH_OVERHEAD_S),
    rdma=(rdma_root, devices) if host.name in coord.rdma_roles else None,
    bench=step,
    bench_s=bench.timeout_s if bench is not None else 0,
)
