"""Release stage: render this host's units from the topology, stage them as a release, switch
all hosts together, gate the topology, then confirm everywhere or roll back everywhere.

    pyinfra inventory/testhosts.py deploys/engines.py --data topology=topologies/demo/demo-pd.yml

Optional `--data` keys: `health_timeout=SECONDS` caps each engine's start timeout;
`confirm_within=SECONDS` (default 300) is how long the gate has before pending hosts revert;
`weights_digest=sha256:...` pins the weights the units check (as for the weights stage);
`bench_tokenizer=DIR` the model's tokenizer on the controller for the SLA bench (`gate.bench:`;
default: AIPerf's built-in encoding, which needs its cache offline); `rdma_sysfs=DIR` where
the RDMA evidence reads port counters. Every key: `hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host, inventory

from hgxserve.deploy.plans import engines_plan
from roles.agent import agent
from roles.engine_user import engine_user
from roles.releases import release

plan = engines_plan(host, inventory)
agent()
engine_user()  # the units' User=: created before any unit of the release starts
release(plan=plan)
