"""RDMA inside engine containers: which container engines need the host's HCAs, the `run` flags
that hand them over, and a preflight check that runs in the image itself (pure, no I/O).

A container gets the GPUs the CDI spec names and nothing else from /dev: without the uverbs and
rdma_cm devices, UCX (NIXL), Mooncake and NCCL see no HCA and fall back to TCP or fail to
register memory. An engine whose KV transfer or DP/EP crosses hosts, or that names RDMA devices
(`kv.ucx_devices`, Mooncake's `--disaggregation-ib-device` from the host's `rdma`, NCCL_IB_HCA),
on a host whose `rdma` lists HCAs, gets:

- `--device /dev/infiniband`: every uverbs, umad and rdma_cm node (podman and docker take a
  directory of devices);
- `--cap-add IPC_LOCK`: pinning (`ibv_reg_mr`) memory for RDMA;
- `--ulimit memlock=-1:-1` and `--ipc host`, which every container engine already gets: the
  host's /dev/shm, sized by the host's `shm` setting (provision), is the container's, so no
  `--shm-size` (it does not apply to a container in the host's IPC namespace).

    >>> fabric_check_argv("/usr/bin/podman", "r/sglang@sha256:" + "a" * 64, ("mlx5_0",))[:4]
    ['/usr/bin/podman', 'run', '--rm', '--pull=never']
"""

from __future__ import annotations

from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import kv_crosses_hosts

INFINIBAND_DEVICES = "/dev/infiniband"
# what a container engine that needs the fabric gets beyond the GPUs
FABRIC_RUN_ARGS = ("--device", INFINIBAND_DEVICES, "--cap-add", "IPC_LOCK")
# the flags every container engine runs with (hgxserve.render), repeated by the check
COMMON_RUN_ARGS = ("--network", "host", "--ipc", "host", "--ulimit", "memlock=-1:-1")

# The check, run by /bin/sh inside the image with the devices it expects as arguments: the HCAs
# the kernel shows, the uverbs nodes that came through, one line starting with FABRIC_MARK.
FABRIC_MARK = "hgxserve-fabric:"
_CHECK = (
    'hcas=$(ls /sys/class/infiniband 2>/dev/null | tr "\\n" " "); '
    'verbs=$(ls /dev/infiniband 2>/dev/null | grep uverbs | tr "\\n" " "); '
    'missing=""; for d in "$@"; do case " $hcas " in *" $d "*) ;; *) missing="$missing $d";; '
    "esac; done; "
    f'echo "{FABRIC_MARK} hcas=$hcas; uverbs=$verbs; missing=$missing"'
)


def fabric_reasons(topo: Topology, engine: Engine, host: str) -> list[str]:
    """Why `engine`'s container on `host` needs the host's HCAs (empty: it does not, or the
    host lists no `rdma` devices to give it)."""
    runtime = engine.runtime
    known = topo.hosts.get(host)
    if runtime is None or not runtime.is_container or known is None or not known.rdma:
        return []
    reasons = []
    kv = engine.kv
    if engine.is_multi_node:
        reasons.append("the engine spans hosts (DP/EP collectives over NCCL)")
    elif kv_crosses_hosts(topo, engine) and not (kv is not None and kv.ucx_tcp_only):
        reasons.append("its KV transfer crosses hosts")
    if kv is not None and kv.ucx_devices is not None:
        reasons.append("kv.ucx_devices names UCX devices")
    if engine.engine == "sglang" and kv is not None and kv.connector == "mooncake":
        reasons.append("Mooncake runs on --disaggregation-ib-device")
    if engine.env.get("NCCL_IB_HCA"):
        reasons.append("NCCL_IB_HCA names HCAs")
    return reasons


def fabric_check_argv(tool: str, image: str, devices: tuple[str, ...]) -> list[str]:
    """`podman|docker run` of `image` with the engine's fabric flags, printing what HCAs it sees:
    never pulls (the runtime stage loads images by digest), changes nothing on the host."""
    return [
        tool,
        "run",
        "--rm",
        "--pull=never",
        *COMMON_RUN_ARGS,
        *FABRIC_RUN_ARGS,
        "--entrypoint",
        "/bin/sh",
        image,
        "-c",
        _CHECK,
        "hgxserve-fabric-check",
        *devices,
    ]


def _field(line: str, name: str) -> list[str]:
    for part in line.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value.split()
    return []


def fabric_check_problem(
    host: str, image: str, devices: tuple[str, ...], output: list[str]
) -> str | None:
    """One `HOST: FACT: expected X, found Y` line when the image does not see the host's HCAs
    (None when it sees every one of `devices`); `output` is what fabric_check_argv printed.

    >>> fabric_check_problem("h20-a", "img", ("mlx5_0",),
    ...     ["hgxserve-fabric: hcas=mlx5_0 ; uverbs=uverbs0 ; missing="]) is None
    True
    """
    want = f"RDMA HCAs {','.join(devices) or '(any)'} visible inside {image}"
    lines = [line.strip() for line in output if line.strip()]
    line = next((x for x in lines if x.startswith(FABRIC_MARK)), None)
    if line is None:
        said = lines[-1] if lines else "no output"
        return f"{host}: container.fabric: expected {want}, found the check could not run: {said}"
    line = line[len(FABRIC_MARK) :]
    hcas, verbs, missing = _field(line, "hcas"), _field(line, "uverbs"), _field(line, "missing")
    if not hcas:
        found = "no HCA in /sys/class/infiniband"
    elif not verbs:
        found = f"{','.join(hcas)} listed but no /dev/infiniband/uverbs* device passed in"
    elif missing:
        found = f"{','.join(hcas)}, without {','.join(missing)}"
    else:
        return None
    return (
        f"{host}: container.fabric: expected {want} (run with --device {INFINIBAND_DEVICES} "
        f"--cap-add IPC_LOCK), found {found}: KV and NCCL would fall back to TCP or fail"
    )


def fabric_images(topo: Topology, host: str) -> list[tuple[str, str]]:
    """(image, tool) of each container engine image on `host` that needs the fabric, sorted,
    as `container_images` names them (tool: podman or docker)."""
    out = set()
    for engine in topo.engines_on(host):
        runtime = engine.runtime
        if runtime is not None and runtime.image and fabric_reasons(topo, engine, host):
            out.add((runtime.image, runtime.tool or "podman"))
    return sorted(out)
