"""Runtime stage: the engine itself on each host — a pinned vLLM / SGLang venv with the extras its
P/D transfer needs (NIXL, Mooncake), from a wheelhouse the controller builds and pushes, or from
an index / mirror the inventory names. Hosts never reach the internet.

    pyinfra inventory/lab.py deploys/runtime.py --data topology=topologies/h20-v4flash-4p4d.yml

Optional `--data` keys (also inventory host data):
`runtime_index_url=URL` where the controller downloads wheels from (default: its own pip
configuration); `runtime_find_links=DIR[,DIR]` local wheel directories the controller also uses;
`runtime_no_index=true` only those directories; `runtime_source=index` makes each host install
from `runtime_index_url` itself (a mirror the hosts can reach) instead of a pushed wheelhouse.

Container runtimes (`runtime.image`): `image_mirror=HOST:PORT` pulls the image through a registry
mirror; `image_archive_prefix=s3://bucket/prefix/` loads `<prefix>/sha256-<hex>.oci.tar`
(an OCI archive, verified against the digest) from the weights' S3 (`image_s3_endpoint`,
`image_s3_env_file`, `image_s3_addressing` override it). See docs/runtime.md.

The topology's `files:` (chat templates, tool-parser plugins, configs) go to
/etc/hgxserve/files/<name> on every host that runs an engine, checked against their sha256.
"""

from functools import partial

from pyinfra import host
from pyinfra.api import DeployError

from hgxserve.deploying import topology_from_data
from hgxserve.facts.runtime import HostPython
from hgxserve.runtime.files import FileSourceError, local_copy
from hgxserve.runtime.images import archive_name, image_digest
from hgxserve.runtime.spec import RuntimeSpecError, container_images, venv_runtimes
from hgxserve.runtime.wheelhouse import (
    HostPlatform,
    IndexOptions,
    WheelhouseError,
    build_wheelhouse,
)
from hgxserve.stages import in_site_run
from hgxserve.topology.model import S3Source
from roles.agent import agent
from roles.container_runtime import container_runtime
from roles.engine_files import engine_files
from roles.nvidia_driver import DRIVER_VERSION
from roles.runtime import runtime_venv


def _flag(name: str) -> bool:
    value = host.data.get(name, False)
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def _wheelhouse(requirements: tuple[str, ...], platform: HostPlatform, index: IndexOptions):
    try:
        return build_wheelhouse(requirements, platform, index)
    except WheelhouseError as exc:
        raise DeployError(f"runtime wheelhouse: {exc}") from None


topology = topology_from_data(host)
if host.name not in topology.hosts:
    raise DeployError(f"{host.name}: not a host of topology {topology.name}")
try:
    specs = venv_runtimes(topology, host.name)
except RuntimeSpecError as exc:
    detail = str(exc).replace("\n", "\n  ")
    raise DeployError(f"runtime: topology {topology.name}:\n  {detail}") from None

source = str(host.data.get("runtime_source", "wheelhouse"))
if source not in ("wheelhouse", "index"):
    raise DeployError(f"runtime_source={source!r}: use wheelhouse or index")
index_url = host.data.get("runtime_index_url")
if source == "index" and not index_url:
    raise DeployError("runtime_source=index needs runtime_index_url (a mirror the hosts reach)")
links = host.data.get("runtime_find_links") or ()
index = IndexOptions(
    index_url=str(index_url) if index_url else None,
    find_links=tuple(links.split(",") if isinstance(links, str) else links),
    no_index=_flag("runtime_no_index"),
)

if specs:
    python = host.get_fact(HostPython)
    if not python.get("version"):
        raise DeployError(f"{host.name}: runtime: the host has no python3 to create a venv with")
    platform = HostPlatform(python["version"], python["machine"], python["glibc"])
    for spec in specs:
        runtime_venv(
            spec=spec,
            wheelhouse=partial(_wheelhouse, spec.requirements, platform, index),
            index_url=str(index_url) if source == "index" else None,
            planned_driver=str(host.data.get("driver_version", DRIVER_VERSION))
            if in_site_run("provision")
            else None,
        )

images = container_images(topology, host.name)
prefix = host.data.get("image_archive_prefix")
# archives come from the same S3 as the weights unless told otherwise
weights_s3 = topology.model.source if isinstance(topology.model.source, S3Source) else None
s3_creds = weights_s3.credentials if weights_s3 else None
s3_endpoint = host.data.get("image_s3_endpoint") or (weights_s3.endpoint if weights_s3 else None)
s3_addressing = host.data.get("image_s3_addressing") or (
    weights_s3.addressing if weights_s3 else "auto"
)
if images and prefix:
    agent()  # image archives are fetched and verified by the agent (`hgxserve runtime fetch-image`)
for image, tool in images:
    digest = image_digest(image)
    container_runtime(
        image=image,
        tool=tool,
        mirror=host.data.get("image_mirror"),
        archive_url=f"{str(prefix).rstrip('/')}/{archive_name(digest)}" if prefix else None,
        s3_env_file=host.data.get("image_s3_env_file")
        or (s3_creds[1] if s3_creds and s3_creds[0] == "env_file" else None),
        s3_endpoint=s3_endpoint,
        s3_addressing=str(s3_addressing),
    )

if topology.files and topology.engines_on(host.name):
    try:
        shipped = [(spec, local_copy(spec)) for spec in topology.files.values()]
    except FileSourceError as exc:
        raise DeployError(f"runtime: {exc}") from None
    engine_files(files=shipped)
