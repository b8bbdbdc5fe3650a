"""Runtime stage: the engine itself on each host — a pinned vLLM / SGLang venv with the extras its
P/D transfer needs (NIXL, Mooncake), from a wheelhouse the controller builds and pushes, or from
an index / mirror the inventory names. Hosts never reach the internet.

    pyinfra inventory/lab.py deploys/runtime.py --data topology=topologies/h20-v4flash-4p4d.yml

Optional `--data` keys (also inventory host data):
`runtime_index_url=URL` where the controller downloads wheels from (default: its own pip
configuration); `runtime_find_links=DIR[,DIR]` local wheel directories the controller also uses;
`runtime_no_index=true` only those directories; `runtime_source=index` makes each host install
from `runtime_index_url` itself (a mirror the hosts can reach) instead of a pushed wheelhouse,
exactly what the lab's hash lock `runtime_index_lock=PATH` pins (`runtime_index_unpinned=true`
is the explicit opt-out).

Container runtimes (`runtime.image`): `image_mirror=HOST:PORT` pulls the image through a registry
mirror; `image_archive_prefix=s3://bucket/prefix/` loads `<prefix>/sha256-<hex>.oci.tar`
(an OCI archive, verified against the digest) from the weights' S3 (`image_s3_endpoint`,
`image_s3_env_file`, `image_s3_addressing` override it). See docs/runtime.md; every key:
`hgxserve deploy-data` (docs/deploy-data.md).

`runtime.wheels` (kernels built in-house) come from the weights' S3 (`url`, fetched by the agent)
or from the controller (`file`), each checked against its sha256 before `pip install --no-deps
--no-index`.

The topology's `files:` (chat templates, tool-parser plugins, configs) go to
/etc/hgxserve/files/<name> on every host that runs an engine, checked against their sha256.
"""

from pyinfra import host

from hgxserve.deploy.plans import runtime_plan
from roles.agent import agent
from roles.container_runtime import container_runtime
from roles.engine_files import engine_files
from roles.runtime import runtime_venv

plan = runtime_plan(host)
if plan.agent:
    agent()  # it fetches and checks image archives and runtime.wheels urls (`hgxserve runtime`)
for venv in plan.venvs:
    runtime_venv(plan=venv)
for image in plan.images:
    container_runtime(plan=image)
if plan.files:
    engine_files(files=plan.files)
