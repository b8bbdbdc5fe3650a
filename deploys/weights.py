"""Weights stage: sync + verify the model (S3, local) or mount + verify/stage it (CephFS).

    pyinfra inventory/lab.py deploys/weights.py --data topology=topologies/h20-v4flash-tp8.yml

Optional `--data` keys: `weights_digest=sha256:...` pins the manifest digest the hosts must
verify against; `agent=/opt/hgxserve/bin/hgxserve` where the agent lives. The agent itself is
installed by `roles.agent` first.
"""

from pyinfra import host
from pyinfra.api import DeployError

from hgxserve.deploying import topology_from_data
from hgxserve.paths import AGENT, cephfs_secret_file
from hgxserve.topology.model import CephfsSource, S3Source
from roles.agent import agent
from roles.weights import weights

topology = topology_from_data(host)
if host.name not in topology.hosts:
    raise DeployError(f"{host.name}: not a host of topology {topology.name}")
model = topology.model
source = model.source
digest = host.data.get("weights_digest")
agent_bin = str(host.data.get("agent", AGENT))

agent()

if isinstance(source, S3Source):
    kind, ref = source.credentials or ("chain", "")
    weights(
        model_name=model.name,
        model_path=model.path,
        source="s3",
        s3_url=source.url,
        endpoint_url=source.endpoint,
        region=source.region,
        addressing=source.addressing,
        env_file=ref if kind == "env_file" else None,
        profile=ref if kind == "profile" else None,
        concurrency=source.concurrency,
        part_size=str(source.part_size),
        manifest_name=model.manifest,
        digest=digest,
        require_sha256=model.integrity == "sha256",
        agent=agent_bin,
    )
elif isinstance(source, CephfsSource):
    secret = source.secret
    if secret.kind not in ("file", "env"):
        raise DeployError(
            f"weights: CephFS secret of kind {secret.kind!r} is not supported; use "
            "{file: /etc/ceph/<user>.secret} (0600 on the host) or {env: VAR} on the controller"
        )
    weights(
        model_name=model.name,
        model_path=model.path,
        source="cephfs",
        cephfs_monitors=source.monitors,
        cephfs_path=source.path,
        cephfs_user=source.user,
        cephfs_secret_file=secret.value
        if secret.kind == "file"
        else cephfs_secret_file(source.user),
        cephfs_secret_env=secret.value if secret.kind == "env" else None,
        cephfs_mount=source.mount,
        stage=source.stage,
        manifest_name=model.manifest,
        digest=digest,
        require_sha256=model.integrity == "sha256",
        agent=agent_bin,
    )
else:
    weights(
        model_name=model.name,
        model_path=model.path,
        source="local",
        local_path=source.path,
        manifest_name=model.manifest,
        digest=digest,
        require_sha256=model.integrity == "sha256",
        agent=agent_bin,
    )
