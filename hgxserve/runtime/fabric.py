"""RDMA inside engine containers: which container engines need the host's HCAs, the `run` flags
that hand them over, and the fabric part of the preflight check that runs in the image itself
(hgxserve.runtime.image_check; pure, no I/O).

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

    >>> FABRIC_RUN_ARGS
    ('--device', '/dev/infiniband', '--cap-add', 'IPC_LOCK')
"""

from __future__ import annotations

from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import kv_crosses_hosts

INFINIBAND_DEVICES = "/dev/infiniband"
# what a container engine that needs the fabric gets beyond the GPUs
FABRIC_RUN_ARGS = ("--device", INFINIBAND_DEVICES, "--cap-add", "IPC_LOCK")
# the flags every container engine runs with (hgxserve.render), repeated by the check
COMMON_RUN_ARGS = ("--network", "host", "--ipc", "host", "--ulimit", "memlock=-1:-1")

# The fabric part of the in-image check (hgxserve.runtime.image_check), run by /bin/sh inside
# the image with the devices it expects in $devs: the HCAs the kernel shows, the uverbs nodes
# that came through, one line starting with FABRIC_MARK.
FABRIC_MARK = "hgxserve-fabric:"
FABRIC_SCRIPT = (
    'hcas=$(ls /sys/class/infiniband 2>/dev/null | tr "\\n" " "); '
    'verbs=$(ls /dev/infiniband 2>/dev/null | grep uverbs | tr "\\n" " "); '
    'missing=""; for d in $devs; do case " $hcas " in *" $d "*) ;; *) missing="$missing $d";; '
    "esac; done; "
    f'echo "{FABRIC_MARK} hcas=$hcas; uverbs=$verbs; missing=$missing"; '
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
    (None when it sees every one of `devices`); `output` is what image_check_argv printed.

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
