"""The container runtime on a real test host: roles/container_runtime.py through deploys/runtime.py.

hgx-a has Debian's podman (the test hosts' root filesystem carries it). The engine image is the
SIMULATED vLLM image testbed/simimage.py builds on the controller from the test hosts' own root
filesystem (nothing downloaded), published as an OCI archive in the weights' S3 (the local moto
server). The role fetches it with the agent, verifies it against the pinned digest, `podman
load`s it and checks the digest podman reports; a tampered archive and an archive of another
image are refused before anything is loaded; a second run changes nothing; a unit runs the image
with `--pull=never` and it serves. Preflight runs the in-image check (hgxserve.runtime.image_check)
for a topology whose engine needs DeepEP: the image's python3 cannot import `deep_ep`, the run
fails with that one line, and nothing changes on the host.

What the test hosts cannot have, and what stands in for it (docs/runtime.md, "Where the container
path stops"): NVIDIA's Container Toolkit is not reachable from here (its apt repository is NVIDIA's
own; Debian has no such package), so `nvidia-container-toolkit` / `-base` are empty stand-in
.debs under the real names and version, and `nvidia-ctk` does not exist. The CDI spec's stamp is
set as if a spec had been generated for the fake nvidia-smi's driver; with an older stamp the
role regenerates, and that is exactly where the run stops: the shell's `nvidia-ctk: not found`.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import demo, simimage
from testbed import hosts as testbed_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "topologies/demo/demo-baseline.yml"
HOST = "hgx-a"
PREFIX = "images/"
TOOLKIT = "1.17.8"
STAND_INS = ("nvidia-container-toolkit", "nvidia-container-toolkit-base")
DRIVER = "570.158.01"  # what the fake nvidia-smi of an H200 test host reports
CDI = "/etc/cdi/nvidia.yaml"
STAMP = "/etc/cdi/.hgxserve-driver"
SERVE_PORT = 8199
CLEAN = (
    "systemctl stop hgx-e2e-container 2>/dev/null; systemctl reset-failed 2>/dev/null; "
    "podman rm --all --force >/dev/null 2>&1; podman rmi --all --force >/dev/null 2>&1; "
    f"apt-mark unhold {' '.join(STAND_INS)} >/dev/null 2>&1; "
    f"dpkg --purge {' '.join(STAND_INS)} >/dev/null 2>&1; "
    "rm -rf /etc/cdi /var/lib/hgxserve/images "
    "/etc/apt/preferences.d/hgxserve-nvidia-container-toolkit; true"
)


def stand_in_deb(work: Path, name: str) -> bytes:
    """An empty .deb under a toolkit package's real name and pinned version."""
    tree = work / name
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {TOOLKIT}-1\nArchitecture: all\n"
        "Maintainer: hgxserve tests <tests@hgxserve.invalid>\n"
        f"Description: hgxserve test stand-in for {name} (no nvidia-ctk inside)\n"
    )
    out = work / f"{name}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(out)],
                   check=True, capture_output=True)  # fmt: skip
    return out.read_bytes()


def s3_client():
    import boto3

    creds = demo.DEMO_CREDENTIALS
    return boto3.client(
        "s3",
        endpoint_url=demo.S3_ENDPOINT,
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        region_name=creds["AWS_DEFAULT_REGION"],
    )


def tampered(archive: Path, out: Path) -> Path:
    """The same archive with one byte of the image's layer changed (its name kept)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            if data is not None and member.size > 1 << 20:
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    return out


@pytest.fixture(scope="module")
def lab(testbed: testbed_hosts.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if testbed.ssh(HOST, "test -x /usr/bin/podman").returncode != 0:
        pytest.fail(f"{HOST} has no podman: its root filesystem predates testbed/rootfs.py")
    work = tmp_path_factory.mktemp("container")
    testbed.ssh(HOST, f"{demo.FORGET_RELEASES}; {CLEAN}", check=True, timeout=120)
    demo.prepare(testbed.names, work)  # the local S3 (the weights') and its credentials
    for name in STAND_INS:
        install = f"cat > /root/{name}.deb && dpkg -i /root/{name}.deb && rm /root/{name}.deb"
        proc = subprocess.run(testbed.ssh_argv(HOST, install), input=stand_in_deb(work, name),
                              capture_output=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    yield testbed, work
    testbed.ssh(HOST, f"{demo.FORGET_RELEASES}; {CLEAN}", timeout=120)
    demo.stop_s3()


def topology(work: Path, image: str) -> Path:
    text = BASELINE.read_text()
    old = "runtime: {venv: /opt/vllm-sim}"
    assert old in text
    path = work / f"container-{image[-8:]}.yml"
    path.write_text(text.replace(old, f"runtime: {{image: {image}, tool: podman}}"))
    return path


def runtime_stage(lab: testbed_hosts.Testbed, topo: Path) -> tuple[int, str]:
    proc = lab.pyinfra(
        "deploys/runtime.py", "--limit", HOST, "--data", f"topology={topo}",
        "--data", f"image_archive_prefix=s3://{demo.BUCKET}/{PREFIX}",
    )  # fmt: skip
    return proc.returncode, re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


def grand_total(text: str) -> tuple[str, ...]:
    match = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text)
    assert match, text[-3000:]
    return match.groups()


def podman_images(lab: testbed_hosts.Testbed) -> str:
    return lab.ssh(HOST, "podman images --all --noheading --format '{{.ID}}'", check=True).stdout


def test_image_loaded_from_s3_by_digest_and_served(lab) -> None:
    bed, work = lab
    archive, digest = simimage.cached_image(Path(bed.rootfs), testbed_hosts.STATE_DIR / "images")
    image = f"{simimage.REPO_NAME}@{digest}"
    name = f"{PREFIX}{digest.replace(':', '-')}.oci.tar"
    s3 = s3_client()
    # the CDI spec as if generated for this host's driver (there is no nvidia-ctk: see above)
    bed.ssh(HOST, f"mkdir -p /etc/cdi && echo '# stand-in' > {CDI} && echo {DRIVER} > {STAMP}",
            check=True)  # fmt: skip

    # 1. the object under the pinned digest's name is tampered with: refused, nothing loaded
    s3.upload_file(str(tampered(archive, work / "bad.tar")), demo.BUCKET, name)
    code, text = runtime_stage(bed, topology(work, image))
    assert code != 0
    assert re.search(r"blob sha256:[0-9a-f]{64} is missing or altered", text), text[-3000:]
    assert "Traceback" not in text
    assert podman_images(bed).strip() == ""
    assert bed.ssh(HOST, "ls -A /var/lib/hgxserve/images/").stdout.strip() == ""

    # 2. an archive of another image under this digest's name (a wrong pin): refused
    other = "sha256:" + "0" * 64
    s3.upload_file(str(archive), demo.BUCKET, f"{PREFIX}{other.replace(':', '-')}.oci.tar")
    code, text = runtime_stage(bed, topology(work, f"{simimage.REPO_NAME}@{other}"))
    assert code != 0
    assert f"holds manifest(s) {digest}, not {other}" in text, text[-3000:]
    assert podman_images(bed).strip() == ""

    # 3. the real archive: fetched, verified, loaded; podman reports the pinned digest
    s3.upload_file(str(archive), demo.BUCKET, name)
    topo = topology(work, image)
    code, text = runtime_stage(bed, topo)
    assert code == 0, text[-4000:]
    assert f"Load {image} from s3://{demo.BUCKET}/{name}" in text
    found = bed.ssh(HOST, f"podman image inspect --format '{{{{.Digest}}}}' {image}", check=True)
    assert found.stdout.strip() == digest
    assert bed.ssh(HOST, "ls -A /var/lib/hgxserve/images/").stdout.strip() == ""  # cleaned up

    # 4. again: nothing changes, nothing is fetched
    code, text = runtime_stage(bed, topo)
    assert code == 0 and grand_total(text)[1:3] == ("-", "-"), text[-3000:]
    assert f"Load {image}" not in text and "Install podman" in text

    # 5. a unit runs the image without pulling and the simulated engine serves from it.
    #    --cgroups=disabled: crun raises RLIMIT_MEMLOCK to load its eBPF device-cgroup filter,
    #    which a test host cannot ("crun: setrlimit (RLIM_MEMLOCK): Operation not permitted":
    #    its hard limit is the controller's 8 MiB, and the controller lacks CAP_SYS_RESOURCE)
    run = (
        "systemd-run --unit hgx-e2e-container --property TimeoutStopSec=20 "
        "/usr/bin/podman run --pull=never --rm --name hgx-e2e-container --network host "
        f"--cgroups=disabled {image} serve /models/tiny --served-model-name tiny "
        f"--host 127.0.0.1 --port {SERVE_PORT}"
    )
    bed.ssh(HOST, run, check=True)
    body = json.dumps({"model": "tiny", "prompt": "Only answer: CTR", "max_tokens": 4})
    ask = (
        f"curl -sf http://127.0.0.1:{SERVE_PORT}/v1/completions "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )
    deadline = time.monotonic() + 60
    while (answer := bed.ssh(HOST, ask)).returncode != 0:
        state = bed.ssh(HOST, "systemctl is-active hgx-e2e-container").stdout.strip()
        log = bed.ssh(HOST, "journalctl -u hgx-e2e-container -n 30 --no-pager").stdout
        assert state in ("active", "activating") and time.monotonic() < deadline, log
        time.sleep(1)
    assert json.loads(answer.stdout)["choices"][0]["text"] == "CTR"
    running = bed.ssh(HOST, "podman ps --filter name=hgx-e2e-container --format '{{.Image}}'")
    assert running.stdout.strip() == image
    log = bed.ssh(HOST, "journalctl -u hgx-e2e-container --no-pager", check=True).stdout
    assert "[SIMULATED vllm]" in log and "Trying to pull" not in log
    with contextlib.suppress(subprocess.TimeoutExpired):
        bed.ssh(HOST, "systemctl stop hgx-e2e-container", timeout=40)

    # 6. the driver changed under the spec: the role regenerates it, and here that needs the
    #    real nvidia-ctk, so the run stops exactly there; the stamp keeps the old driver
    bed.ssh(HOST, f"echo 565.57.01 > {STAMP}", check=True)
    code, text = runtime_stage(bed, topo)
    assert code != 0
    assert f"Generate the CDI spec for driver {DRIVER} (was 565.57.01)" in text, text[-3000:]
    assert re.search(r"nvidia-ctk: (command )?not found", text), text[-3000:]
    assert bed.ssh(HOST, f"cat {STAMP}").stdout.strip() == "565.57.01"


# The in-image preflight check on a test host needs two stand-ins, each for what the test hosts
# cannot have (docs/runtime.md, "The in-image check on the test hosts"): a CDI spec naming the
# GPUs (there is no nvidia-ctk to generate one; its GPUs only set a variable, as there are no
# /dev/nvidia* nodes), and `cgroups = "disabled"` for podman (crun loads its eBPF device-cgroup
# filter by raising RLIMIT_MEMLOCK, which the test hosts cannot).
CDI_STAND_IN = "\n".join(
    [
        'cdiVersion: "0.3.0"',
        "kind: nvidia.com/gpu",
        "devices:",
        *(
            f'  - {{name: "{gpu}", containerEdits: {{env: [HGXSERVE_STAND_IN_GPU={gpu}]}}}}'
            for gpu in range(8)
        ),
        "",
    ]
)
CONTAINERS_CONF = "/etc/containers/containers.conf"
NO_CGROUPS = 'cgroups = "disabled"\n'
# what must not change: engine units, releases, containers, images
HOST_STATE = (
    "ls -A /etc/systemd/system | grep '^hgxserve-'; ls -A /var/lib/hgxserve; "
    "podman ps --all --format '{{.Names}}'; podman images --noheading --format '{{.ID}}'; true"
)


def write(bed: testbed_hosts.Testbed, path: str, text: str) -> None:
    proc = subprocess.run(bed.ssh_argv(HOST, f"cat > {path}"), input=text.encode(),
                          capture_output=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")


def deepep_topology(work: Path, image: str) -> Path:
    """The container topology with a deepep all-to-all backend: DeepEP required, NVSHMEM advised
    (hgxserve/topology/kernels.py); the simulated image has neither."""
    text = topology(work, image).read_text()
    old = "    max_num_seqs: 8\n"
    assert old in text
    path = work / "container-deepep.yml"
    path.write_text(text.replace(old, old + "    all2all_backend: deepep_low_latency\n"))
    return path


def test_preflight_imports_the_kernels_inside_the_image(lab) -> None:
    bed, work = lab
    archive, digest = simimage.cached_image(Path(bed.rootfs), testbed_hosts.STATE_DIR / "images")
    image = f"{simimage.REPO_NAME}@{digest}"
    s3_client().upload_file(
        str(archive), demo.BUCKET, f"{PREFIX}{digest.replace(':', '-')}.oci.tar"
    )
    bed.ssh(HOST, f"mkdir -p /etc/cdi && echo {DRIVER} > {STAMP}", check=True)
    write(bed, CDI, CDI_STAND_IN)  # as if generated for this host's driver
    code, text = runtime_stage(bed, topology(work, image))  # loads it (or finds it loaded)
    assert code == 0, text[-4000:]
    conf = bed.ssh(HOST, f"cat {CONTAINERS_CONF}", check=True).stdout
    assert "[containers]\n" in conf
    write(bed, CONTAINERS_CONF, conf.replace("[containers]\n", "[containers]\n" + NO_CGROUPS))
    try:
        before = bed.ssh(HOST, HOST_STATE, check=True).stdout
        started = time.monotonic()
        topo = deepep_topology(work, image)
        proc = bed.pyinfra("deploys/preflight.py", "--limit", HOST, "--data", f"topology={topo}")
        took = time.monotonic() - started
        text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
        after = bed.ssh(HOST, HOST_STATE, check=True).stdout
    finally:
        write(bed, CONTAINERS_CONF, conf)
    assert proc.returncode != 0
    why = "for args.all2all_backend deepep_low_latency"
    assert (
        f"hgx-a: container.kernels: expected deep_ep (DeepEP {why}) importable in {image}, "
        "found deep_ep: ModuleNotFoundError: No module named 'deep_ep': the engine cannot start"
    ) in text, text[-4000:]
    # NVSHMEM is advised only: a warning, not a refusal
    assert (
        f"hgx-a: container.kernels: expected nvidia.nvshmem (NVSHMEM {why}) importable in "
        f"{image}, found nvidia.nvshmem: ModuleNotFoundError: No module named 'nvidia': "
        "the engine runs on slower paths without them"
    ) in text, text[-4000:]
    assert "container.fabric" not in text and "Traceback" not in text
    # nothing changed: no unit, no release, no container left behind, the same images
    assert after == before
    assert bed.ssh(HOST, "ls /etc/systemd/system/ | grep -c '^hgxserve-'").stdout.strip() == "0"
    assert took < 120, took
