"""Weights stage: sync + verify the model (S3, local) or mount + verify/stage it (CephFS).

    pyinfra inventory/lab.py deploys/weights.py --data topology=topologies/h20-v4flash-tp8.yml

Optional `--data` keys: `weights_digest=sha256:...` pins the manifest digest the hosts must
verify against (default: the topology's `model.digest`; the engine units check the same one);
`agent=/opt/hgxserve/bin/hgxserve` where the agent lives. The agent itself is installed by
`roles.agent` first.
"""

from pyinfra import host
from pyinfra.api import DeployError

from hgxserve.deploying import topology_from_data
from hgxserve.paths import AGENT
from roles.agent import agent
from roles.weights import weights

topology = topology_from_data(host)
if host.name not in topology.hosts:
    raise DeployError(f"{host.name}: not a host of topology {topology.name}")

agent()
weights(
    model=topology.model,
    digest=host.data.get("weights_digest") or topology.model.digest,  # --data overrides the pin
    agent=str(host.data.get("agent", AGENT)),
)
