"""Every path hgxserve uses on a host, written once.

Library, roles, deploys and CLIs take their host paths from here; a path given on the command
line or as a role argument still wins, these are only the defaults.

>>> AGENT
'/opt/hgxserve/bin/hgxserve'
>>> weights_state_dir("DeepSeek-V4-Flash")
'/var/lib/hgxserve/weights/DeepSeek-V4-Flash'
"""

from __future__ import annotations

# The hgxserve agent: a venv on every host, installed by roles/agent.py.
AGENT_PREFIX = "/opt/hgxserve"
AGENT = f"{AGENT_PREFIX}/bin/hgxserve"

# State: releases, symlinks current/previous/baseline, pending.json, engine run dirs, weights state.
STATE_ROOT = "/var/lib/hgxserve"
RELEASE_ROOT = STATE_ROOT
RUN_ROOT = f"{STATE_ROOT}/run"
WEIGHTS_STATE_ROOT = f"{STATE_ROOT}/weights"
# The engine user's home (its only writable place outside the engines' cache and run dirs), for
# libraries that write under $HOME although every cache variable is pinned elsewhere.
ENGINE_HOME = f"{STATE_ROOT}/engine-home"
AGENT_STAGING = f"{STATE_ROOT}/agent"

# Configuration: proxy.json, env-referenced secrets (0600), CephFS secrets.
CONFIG_DIR = "/etc/hgxserve"
PROXY_CONFIG = f"{CONFIG_DIR}/proxy.json"
# The watchers of engines that span hosts: their config (in the release tree) and their state
# (generation, restarts, events; read by `hgxserve status`), one file per engine.
WATCH_CONFIG_DIR = f"{CONFIG_DIR}/watch"
WATCH_STATE_DIR = f"{STATE_ROOT}/watch"
CREDENTIALS_DIR = f"{CONFIG_DIR}/credentials"
# The host firewall (a release file, loaded with `nft -f`) and the one nftables table it owns.
FIREWALL_FILE = f"{CONFIG_DIR}/firewall.nft"
FIREWALL_TABLE = "inet hgxserve"
# what the deploy adds to the table (the controller's address), included by FIREWALL_FILE
FIREWALL_INCLUDE_DIR = f"{CONFIG_DIR}/firewall.d"
FIREWALL_CONTROLLER_FILE = f"{FIREWALL_INCLUDE_DIR}/controller.nft"
NFT = "/usr/sbin/nft"

# systemd: unit files, and where LoadCredential= puts a unit's credentials at run time.
UNIT_DIR = "/etc/systemd/system"
RUN_CREDENTIALS_DIR = "/run/credentials"

# RDMA NIC port counters (<dev>/ports/<n>/counters/port_{xmit,rcv}_data): the gate's P/D evidence.
RDMA_SYSFS = "/sys/class/infiniband"
# The fabric preflight's ib_write_bw servers write their output here while the clients measure.
FABRIC_RUN_DIR = f"{STATE_ROOT}/fabric"

# JIT/compile caches, one directory per cache key.
CACHE_ROOT = "/var/cache/hgxserve"

# Engine runtimes (deploys/runtime.py): a wheelhouse while it installs, the pins each runtime
# venv holds (a file in the venv), the files a topology ships, image archives while they load.
RUNTIME_STAGING = f"{STATE_ROOT}/runtime"
RUNTIME_MARKER = ".hgxserve-runtime"
TOPOLOGY_FILES_DIR = f"{CONFIG_DIR}/files"
IMAGE_STAGING = f"{STATE_ROOT}/images"

# Containers: the CDI spec and the driver it was generated for, the registry mirror drop-in,
# the apt pin of the NVIDIA Container Toolkit.
CDI_SPEC = "/etc/cdi/nvidia.yaml"
CDI_STAMP = "/etc/cdi/.hgxserve-driver"
REGISTRY_MIRROR_DROPIN = "/etc/containers/registries.conf.d/50-hgxserve-mirror.conf"
TOOLKIT_APT_PREFERENCES = "/etc/apt/preferences.d/hgxserve-nvidia-container-toolkit"


def weights_state_dir(model_name: str) -> str:
    """Where verify state and the marker live for weights verified in place."""
    return f"{WEIGHTS_STATE_ROOT}/{model_name}"


def cephfs_secret_file(user: str) -> str:
    """The default CephFS secret file for a client user (with the other pushed secrets, in the
    0700 credentials directory)."""
    return f"{CREDENTIALS_DIR}/cephfs-{user}.secret"


def unit_credentials_dir(unit: str) -> str:
    """Where systemd exposes a unit's LoadCredential= files while it runs."""
    return f"{RUN_CREDENTIALS_DIR}/{unit}"


# Monitoring (deploys/monitoring.py): Prometheus' own config directory (Debian's package), the
# drop-in directory inside it (file_sd targets, rules) that its config names relative to itself,
# the package's ARGS file, node exporter's ARGS file, the DCGM exporter's counters file and the
# folder a Grafana file provider reads dashboards from.
PROMETHEUS_DIR = "/etc/prometheus"
PROMETHEUS_DROPIN = "hgxserve"
PROMETHEUS_DEFAULTS = "/etc/default/prometheus"
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"
MONITORING_CONFIG_DIR = f"{CONFIG_DIR}/monitoring"
DCGM_COUNTERS = f"{MONITORING_CONFIG_DIR}/dcgm-counters.csv"
GRAFANA_DASHBOARDS_DIR = "/var/lib/grafana/dashboards/hgxserve"
# the keys Prometheus sends (the proxy's /metrics key), relative to PROMETHEUS_DIR as the
# drop-in is: a directory of its own, root:prometheus 0750, each file 0640
PROMETHEUS_KEYS = "hgxserve-keys"


def prometheus_proxy_key(topology: str) -> str:
    """The proxy's /metrics key for Prometheus, relative to PROMETHEUS_DIR."""
    return f"{PROMETHEUS_KEYS}/{topology}-proxy-metrics.key"
