"""Container runtime role: podman (or docker) with the NVIDIA Container Toolkit, a CDI spec that
follows the driver, and the engine image loaded by digest before any release switch.

- packages: `podman` / `docker.io` and `nvidia-container-toolkit` at a pinned version (from the
  apt source provision configured: NVIDIA's repository or the lab mirror);
- CDI: `nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`, again whenever the driver
  version differs from the one the spec was generated for (a stamp beside it);
- image: present with the pinned digest, or pulled through a registry mirror
  (registries.conf drop-in), or loaded from an OCI archive fetched from S3 by the agent and
  verified against the digest before `podman load`; the digest is checked after loading.
  Units run with `--pull=never`, so nothing is pulled inside the switch window.

Example:
    container_runtime(plan=image)  # an ImagePlan of hgxserve.deploy.plans.runtime_plan(host).images
    container_runtime(image="docker.io/vllm/vllm-openai@sha256:...", tool="podman",
                      archive_url="s3://models/images/sha256-....oci.tar")
"""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra import host
from pyinfra.api import DeployError, deploy
from pyinfra.operations import files, server

from hgxserve.base.paths import (
    AGENT,
    CDI_SPEC,
    CDI_STAMP,
    IMAGE_STAGING,
    TOOLKIT_APT_PREFERENCES,
)
from hgxserve.base.paths import REGISTRY_MIRROR_DROPIN as MIRROR_DROPIN
from hgxserve.deploy.plans import ImagePlan, plan_or_fields
from hgxserve.facts.runtime import CdiSpecState, ContainerImage, DriverCuda
from hgxserve.operations.packages import APT_CACHE_SECONDS, pinned_packages
from hgxserve.runtime.images import archive_name, image_digest

# NVIDIA Container Toolkit release pinned with the 570 driver default (roles.nvidia_driver)
TOOLKIT_VERSION = "1.17.8"
TOOL_PACKAGES = {"podman": "podman", "docker": "docker.io"}
TOOL_BIN = {"podman": "/usr/bin/podman", "docker": "/usr/bin/docker"}
TOOLKIT_PACKAGES = (
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container1",
    "libnvidia-container-tools",
)


def toolkit_preferences(version: str) -> str:
    """apt preferences holding the toolkit and its libraries at one upstream version.

    >>> print(toolkit_preferences("1.17.8"), end="")  # doctest: +ELLIPSIS
    Package: nvidia-container-toolkit ... libnvidia-container-tools
    Pin: version 1.17.8-*
    Pin-Priority: 1001
    """
    return f"Package: {' '.join(TOOLKIT_PACKAGES)}\nPin: version {version}-*\nPin-Priority: 1001\n"


def image_registry(image: str) -> str:
    """The registry an image reference pulls from (docker.io when it names none).

    >>> image_registry("lmsysorg/sglang@sha256:ab"), image_registry("nvcr.io/nim/x@sha256:ab")
    ('docker.io', 'nvcr.io')
    """
    first, slash, _ = image.split("@", 1)[0].partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def mirror_conf(registry: str, mirror: str) -> str:
    """registries.conf drop-in sending pulls from `registry` to `mirror` (digests unchanged).

    >>> print(mirror_conf("docker.io", "registry.lab:5000"), end="")
    [[registry]]
    location = "docker.io"
    [[registry.mirror]]
    location = "registry.lab:5000"
    """
    return f'[[registry]]\nlocation = "{registry}"\n[[registry.mirror]]\nlocation = "{mirror}"\n'


@deploy("Install the container runtime")
def container_runtime(
    *,
    plan: ImagePlan | None = None,
    toolkit_version: str = TOOLKIT_VERSION,
    cache_time: int = APT_CACHE_SECONDS,
    **fields: Any,
) -> None:
    """Install the tool and toolkit, keep the CDI spec at the driver, load the image by digest.

    + plan: the image (hgxserve.deploy.plans.ImagePlan), or its fields as keywords instead:
      image: repo@sha256:<64 hex>, as the topology pins it; tool: podman or docker;
      mirror: registry mirror (host[:port]) the image is pulled through;
      archive_url: s3:// URL of an OCI archive of the image (used when no mirror is given);
      s3_env_file, s3_endpoint, s3_addressing: how the agent reaches that S3
    + toolkit_version: nvidia-container-toolkit version
    + cache_time: seconds the apt lists count as fresh
    """
    plan = plan_or_fields(plan, ImagePlan, fields)
    image, tool, mirror, archive_url = plan.image, plan.tool, plan.mirror, plan.archive_url
    if tool not in TOOL_PACKAGES:
        raise DeployError(f"{host.name}: container tool {tool!r}: use podman or docker")
    digest = image_digest(image)
    # apt installs the pinned toolkit (and its libraries), as the driver role pins the driver
    files.put(
        name=f"Pin the NVIDIA Container Toolkit at {toolkit_version}",
        src=_text(toolkit_preferences(toolkit_version)),
        dest=TOOLKIT_APT_PREFERENCES,
        mode="644",
    )
    pinned_packages(
        name=f"Install the NVIDIA Container Toolkit {toolkit_version}",
        packages=["nvidia-container-toolkit", "nvidia-container-toolkit-base"],
        version=toolkit_version,
        hold=True,
        cache_time=cache_time,
    )
    pinned_packages(
        name=f"Install {tool}",
        packages=[TOOL_PACKAGES[tool]],
        cache_time=cache_time,
    )

    driver = host.get_fact(DriverCuda)
    cdi = host.get_fact(CdiSpecState, spec=CDI_SPEC, stamp=CDI_STAMP)
    version = driver.get("driver_version")
    if not version:
        host.noop("no NVIDIA driver answers yet: the CDI spec is generated once it does")
    elif cdi.get("present") and cdi.get("driver") == version:
        host.noop(f"CDI spec {CDI_SPEC} already matches driver {version}")
    else:
        server.shell(
            name=f"Generate the CDI spec for driver {version}"
            + (f" (was {cdi['driver']})" if cdi.get("driver") else ""),
            commands=[
                f"nvidia-ctk cdi generate --output={CDI_SPEC}",
                "nvidia-ctk cdi list | grep -q 'nvidia.com/gpu='",
                f"echo {shlex.quote(version)} > {CDI_STAMP}",
            ],
        )

    state = host.get_fact(ContainerImage, tool=TOOL_BIN[tool], image=image)
    if state.get("digest") == digest:
        host.noop(f"image {image} is already loaded")
        return
    check = (
        f"test \"$({TOOL_BIN[tool]} image inspect --format '{{{{.Digest}}}}' "
        f'{shlex.quote(image)})" = {digest}'
    )
    if mirror:
        registry = image_registry(image)
        files.put(
            name=f"Pull {registry} images through the mirror {mirror}",
            src=_text(mirror_conf(registry, mirror)),
            dest=MIRROR_DROPIN,
            mode="644",
            create_remote_dir=True,
        )
        server.shell(
            name=f"Pull {image} through {mirror}",
            commands=[f"{TOOL_BIN[tool]} pull {shlex.quote(image)}", check],
        )
        return
    if not archive_url:
        raise DeployError(
            f"{host.name}: image {image} is not loaded and there is no source: give "
            "--data image_mirror=HOST:PORT or --data image_archive_prefix=s3://bucket/prefix/"
        )
    archive = f"{IMAGE_STAGING}/{archive_name(digest)}"
    fetch = [AGENT, "runtime", "fetch-image", archive_url, digest, "--out", archive]
    if plan.s3_env_file:
        fetch += ["--env-file", plan.s3_env_file]
    if plan.s3_endpoint:
        fetch += ["--endpoint-url", plan.s3_endpoint]
    fetch += ["--addressing", plan.s3_addressing]
    server.shell(
        name=f"Load {image} from {archive_url} (digest checked before and after)",
        commands=[
            shlex.join(fetch),
            f"{TOOL_BIN[tool]} load -i {shlex.quote(archive)}",
            check,
            f"rm -f {shlex.quote(archive)}",
        ],
    )


def _text(body: str):
    import io

    return io.StringIO(body)
