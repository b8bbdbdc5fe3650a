"""Tune an HGX host for inference engines: /dev/shm size, memlock for units, sysctl, tmpfiles.

Each part changes the host only when it differs from what is wanted, and reacts only to its
own change: `systemctl daemon-reexec` when the memlock drop-in changed, `sysctl -p` when the
sysctl file changed, a live `/dev/shm` remount when the mounted size differs.

Example:
    from roles.host_tuning import host_tuning
    host_tuning(shm_size="128Gi")
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import files, server

from hgxserve.base.sizes import parse_size
from hgxserve.operations.tuning import shm_remounted, tmpfs_size_option
from roles.nvidia_driver import TEMPLATES

MEMLOCK_DROPIN = "/etc/systemd/system.conf.d/hgxserve-memlock.conf"
MEMLOCK_LIMITS = "/etc/security/limits.d/90-hgxserve-memlock.conf"
SYSCTL_FILE = "/etc/sysctl.d/90-hgxserve.conf"
TMPFILES_FILE = "/etc/tmpfiles.d/hgxserve-shm.conf"
FSTAB = "/etc/fstab"
DEFAULT_SHM_SIZE = "64Gi"

# key -> (value, why): the reason is written above each line in the sysctl file.
SYSCTL_DEFAULTS: dict[str, tuple[str, str]] = {
    "vm.max_map_count": (
        "1048576",
        "engines mmap hundreds of safetensors shards plus CUDA/UCX regions; 65530 is too few",
    ),
    "kernel.numa_balancing": (
        "0",
        "automatic NUMA balancing migrates pinned engine memory and causes latency spikes",
    ),
    "net.core.rmem_max": (
        "268435456",
        "UCX/NIXL TCP fallback and weight downloads need socket buffers above 208 KiB",
    ),
    "net.core.wmem_max": (
        "268435456",
        "UCX/NIXL TCP fallback and weight downloads need socket buffers above 208 KiB",
    ),
    "net.ipv4.tcp_rmem": ("4096 87380 268435456", "let TCP autotuning use the larger buffers"),
    "net.ipv4.tcp_wmem": ("4096 65536 268435456", "let TCP autotuning use the larger buffers"),
    "net.core.somaxconn": ("4096", "the proxy and engines accept bursts of client connections"),
}

# Segments engines leave in /dev/shm after a crash or SIGKILL (sources in docs/provision.md).
SHM_LEAK_PATTERNS = (
    "nccl-*",  # NCCL shared-memory transport
    "ucx_shm_posix_*",  # UCX posix shared-memory transport
    "psm_*",  # Python multiprocessing.shared_memory (vLLM shm broadcast)
    "sem.mp-*",  # Python multiprocessing semaphores
    "sem.loky-*",  # joblib/loky semaphores
    "torch_*",  # torch.multiprocessing file_system sharing
    "vllm_offload_*",  # vLLM CPU KV offload region
    "sgl_shm_mm_*",  # SGLang multimodal shared memory
)


@deploy("Tune the host for inference engines")
def host_tuning(  # noqa: PLR0913 - a pyinfra @deploy: one keyword per tuning option
    shm_size: str | int = DEFAULT_SHM_SIZE,
    remount_shm: bool = True,
    memlock: bool = True,
    sysctl: dict[str, tuple[str, str]] | None = None,
    apply_sysctl: bool = True,
    shm_leak_patterns: tuple[str, ...] | list[str] = SHM_LEAK_PATTERNS,
) -> None:
    """Size /dev/shm, lift memlock for systemd units, apply sysctls, clear leaked shm at boot.

    + shm_size: /dev/shm size (`128Gi`, or bytes)
    + remount_shm: also resize the mounted /dev/shm now (no reboot needed)
    + memlock: DefaultLimitMEMLOCK=infinity for all units, unlimited for login shells
    + sysctl: key -> (value, reason); default SYSCTL_DEFAULTS
    + apply_sysctl: run `sysctl -p` when the file changed (off where /proc/sys is read-only)
    + shm_leak_patterns: /dev/shm names the tmpfiles rule removes

    Example:
        host_tuning(shm_size="128Gi", apply_sysctl=True)
    """
    size_bytes = parse_size(shm_size)
    size = tmpfs_size_option(size_bytes)
    files.line(
        name=f"Size /dev/shm to {size} in fstab",
        path=FSTAB,
        line=r"^[^#[:space:]]*[[:space:]][[:space:]]*/dev/shm[[:space:]].*$",
        replace=f"tmpfs /dev/shm tmpfs rw,nosuid,nodev,size={size} 0 0",
    )
    if remount_shm:
        shm_remounted(name=f"Resize the mounted /dev/shm to {size}", size_bytes=size_bytes)

    if memlock:
        dropin = files.put(
            name="Set DefaultLimitMEMLOCK=infinity for systemd units",
            src=str(TEMPLATES / "systemd-memlock.conf"),
            dest=MEMLOCK_DROPIN,
            mode="644",
        )
        _when_changed(
            dropin,
            "Re-execute systemd so new units get the memlock limit",
            "systemctl daemon-reexec",
        )
        files.put(
            name="Set memlock unlimited for login shells",
            src=str(TEMPLATES / "limits-memlock.conf"),
            dest=MEMLOCK_LIMITS,
            mode="644",
        )

    settings = SYSCTL_DEFAULTS if sysctl is None else sysctl
    sysctl_file = files.template(
        name="Write sysctl settings for large inference hosts",
        src=str(TEMPLATES / "sysctl.conf.j2"),
        dest=SYSCTL_FILE,
        mode="644",
        settings=settings,
    )
    if apply_sysctl:
        _when_changed(sysctl_file, "Apply the changed sysctl settings", f"sysctl -p {SYSCTL_FILE}")

    files.template(
        name="Remove leaked engine segments from /dev/shm at boot",
        src=str(TEMPLATES / "tmpfiles-shm.conf.j2"),
        dest=TMPFILES_FILE,
        mode="644",
        patterns=list(shm_leak_patterns),
        path=TMPFILES_FILE,
    )


def _when_changed(written: OperationMeta, name: str, command: str) -> None:
    """Run `command` only when the file operation `written` changed its file (`_if` is
    evaluated when the operations execute)."""
    server.shell(name=name, commands=[command], _if=written.did_change)
