"""The API keys a deploy pushes or points the units at, checked before anything runs: the
proxy's client key (`proxy.auth.api_key`), the engines' key (`proxy.auth.engine_api_key`) and the
key of the proxy's /metrics (`proxy.auth.metrics_key`).

- `{env: VAR}`: the controller's VAR must hold a key of MIN_API_KEY_LENGTH characters or more
  (the release role then writes it 0600 itself);
- `{file: PATH}` on the host: PATH must be a regular file, mode 0600 or stricter, of at least
  MIN_API_KEY_LENGTH bytes (its length read from the host's `File` fact; the proxy checks the
  key itself, exactly, when it starts: hgxserve.proxy.config.read_api_key);
- `{credential: NAME}`: the same for the credential store file systemd would load
  (/etc/credstore/NAME, ...), where one is there (an encrypted store is systemd's to check).

No message says a key.
"""

from __future__ import annotations

import os

from pyinfra.api import DeployError
from pyinfra.api.host import Host
from pyinfra.facts.files import File

from hgxserve.base.apikeys import key_problem
from hgxserve.base.credstore import CREDENTIAL_STORES
from hgxserve.base.defaults import MIN_API_KEY_LENGTH
from hgxserve.topology import Topology
from hgxserve.topology.model import SecretRef
from hgxserve.topology.problems import JsonPath, format_path
from hgxserve.topology.wiring import host_credentials

AUTH = ("proxy", "auth")


def api_key_refs(topo: Topology) -> list[tuple[JsonPath, SecretRef]]:
    """(where, reference) of the topology's API keys."""
    proxy = topo.proxy
    if proxy is None:
        return []
    keys = (
        ("api_key", proxy.api_key),
        ("engine_api_key", proxy.engine_api_key),
        ("metrics_key", proxy.metrics_key),
    )
    return [((*AUTH, name), ref) for name, ref in keys if ref is not None]


def check_env_keys(topo: Topology) -> None:
    """A DeployError for an `{env: VAR}` API key whose value on the controller is too short."""
    for at, ref in api_key_refs(topo):
        value = os.environ.get(ref.value) if ref.kind == "env" else None
        problem = key_problem(value.strip()) if value is not None else None
        if problem:
            raise DeployError(
                f"{topo.source_file}: {format_path(at)}: the API key in the controller's "
                f"environment variable {ref.value}: {problem}"
            )


def _host_paths(ref: SecretRef) -> list[str]:
    if ref.kind == "file":
        return [ref.value]
    return [os.path.join(store, ref.value) for store in CREDENTIAL_STORES]


def _file_problem(info: object) -> str | None:
    if info is False or not isinstance(info, dict):
        return "not a regular file"
    mode = int(str(info.get("mode", 600)), 8)
    if mode & 0o077:
        return f"mode {mode:04o} lets group or others at it (chmod 600)"
    if int(info.get("size") or 0) < MIN_API_KEY_LENGTH:
        return f"{info.get('size')} bytes, shorter than the {MIN_API_KEY_LENGTH} a key needs"
    return None


def check_host_key_files(topo: Topology, host: Host) -> None:
    """A DeployError for an API key file on `host` its units load that is missing (`file:`),
    not a regular file, readable by group or others, or too short to hold a key."""
    for cred in host_credentials(topo, host.name):
        if cred.at[:2] != AUTH or cred.ref.kind == "env":
            continue
        for path in _host_paths(cred.ref):
            info = host.get_fact(File, path=path)
            if info is None and cred.ref.kind == "credential":
                continue  # systemd looks in the next store
            problem = "not on the host" if info is None else _file_problem(info)
            if problem:
                raise DeployError(
                    f"{host.name}: {format_path(cred.at)}: API key file {path}: {problem}"
                )
            break
