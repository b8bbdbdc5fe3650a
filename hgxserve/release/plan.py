"""Controller side: what one host's release is, from a validated topology and its render."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from hgxserve.digests import tree_digest
from hgxserve.release.store import ReleaseSpec, UnitSpec
from hgxserve.render import credential_for, render_host
from hgxserve.topology import Topology
from hgxserve.topology.model import SecretRef, is_loopback
from hgxserve.topology.ports import engine_url


@dataclass
class HostRelease:
    """A host's release: its spec (release.json), the files of its tree, and the secrets the
    controller must push (as 0600 files) for the units' LoadCredential= lines."""

    host: str
    spec: ReleaseSpec
    files: dict[str, tuple[str, int]]
    secrets: dict[str, SecretRef] = field(default_factory=dict)  # host path -> reference

    @property
    def id(self) -> str:
        return self.spec.id


def _local_url(bind: str | None, port: int, path: str) -> str:
    host = "127.0.0.1" if bind in (None, "", "0.0.0.0", "::") or is_loopback(bind or "") else bind
    return f"http://{host}:{port}{path}"


def _credential_source(ref: SecretRef) -> str:

    if ref.kind == "credential":
        return f"/etc/credstore/{ref.value}"
    _, line, path = credential_for("API_KEY", ref)
    return path or line.split(":", 1)[1]


def gate_host(topo: Topology) -> str | None:
    """The host that runs the topology-wide gate: the proxy's host."""
    return topo.proxy.host if topo.proxy else None


def gate_spec(topo: Topology) -> dict[str, object] | None:
    proxy = topo.proxy
    if proxy is None:
        return None
    decode_metrics = []
    pd_engine = None
    for route in proxy.routes:
        for name in route.decode:
            engine = topo.engines[name]
            pd_engine = engine.engine
            addr = "127.0.0.1" if engine.head == proxy.host else topo.hosts[engine.head].address
            decode_metrics.append(f"http://{addr}:{engine.port}/metrics")
    words = max(64, proxy.pd_min_prompt_tokens * 2)  # an English word is >= 1 token
    api_key_file = None
    if proxy.api_key is not None:
        # the gate runs as root on the proxy's host and reads the key where the unit loads it from
        api_key_file = _credential_source(proxy.api_key)
    return {
        "proxy_url": _local_url(proxy.listen_host, proxy.listen_port, ""),
        "served_name": topo.model.served_name,
        "api_key_file": api_key_file,
        "pd_engine": pd_engine if proxy.routes else None,
        "decode_metrics": sorted(set(decode_metrics)),
        "prompt_words": words if proxy.routes else 16,
    }


def plan_release(topo: Topology, host: str, *, health_timeout_s: float = 900.0) -> HostRelease:
    """The release `host` gets for `topo` (an empty one when the topology leaves it unused)."""
    files: dict[str, tuple[str, int]] = {}
    units: list[UnitSpec] = []
    secrets: dict[str, SecretRef] = {}
    if host in topo.hosts_in_use():
        rendered = render_host(topo, host)
        files = rendered.tree
        secrets = {c.path: c.ref for c in rendered.credentials if c.path is not None}
        for unit in rendered.units:
            if unit.engine is None:
                proxy = topo.proxy
                assert proxy is not None
                url = _local_url(proxy.listen_host, proxy.listen_port, "/health")
                units.append(UnitSpec(unit.name, "proxy", url, []))
                continue
            engine = topo.engines[unit.engine]
            if host == engine.head:
                url = engine_url(topo, engine, from_host=host) + "/health"
                units.append(UnitSpec(unit.name, "engine", url, list(unit.gpus)))
            else:
                units.append(UnitSpec(unit.name, "worker", None, list(unit.gpus)))
    gate = gate_spec(topo) if host == gate_host(topo) else None
    tree = tree_digest(files)
    identity = json.dumps(
        {
            "tree": tree,
            "units": [u.__dict__ for u in units],
            "gate": gate,
            "topology": topo.digest,
        },
        sort_keys=True,
    )
    release_id = hashlib.sha256(identity.encode()).hexdigest()[:12]
    spec = ReleaseSpec(
        id=release_id,
        topology=topo.name,
        topology_digest=topo.digest,
        baseline=topo.baseline,
        host=host,
        units=units,
        files={path: mode for path, (_, mode) in files.items()},
        health_timeout_s=health_timeout_s,
        gate=gate,
        tree_digest=tree,
    )
    return HostRelease(host, spec, files, secrets)
