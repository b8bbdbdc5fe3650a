"""Weights stage: sync + verify the model (S3, local) or mount + verify/stage it (CephFS).

    pyinfra inventory/lab.py deploys/weights.py --data topology=topologies/h20-v4flash-tp8.yml

Optional `--data` keys: `weights_digest=sha256:...` pins the manifest digest the hosts must
verify against (default: the topology's `model.digest`; the engine units check the same one);
`agent=/opt/hgxserve/bin/hgxserve` where the agent lives. The agent itself is installed by
`roles.agent` first. Every key: `hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host

from hgxserve.deploy.plans import weights_plan
from roles.agent import agent
from roles.weights import weights

plan = weights_plan(host)
agent()
weights(plan=plan)
