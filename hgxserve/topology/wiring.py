"""What the units of a topology load and speak, as the topology means it: the proxy's P/D
protocol, each unit's secrets and the credential name each is loaded under.

The renderer writes these (hgxserve.render); the rules (hgxserve.topology.rules) refuse a
topology for which they cannot be written, so whatever `validate` accepts renders.

>>> credential_for("HF_TOKEN", SecretRef("env", "HF_TOKEN"))
('hf-token', 'hf-token:/etc/hgxserve/credentials/hf-token', '/etc/hgxserve/credentials/hf-token')
"""

from __future__ import annotations

from dataclasses import dataclass

from hgxserve.base.enginekey import ENGINE_KEY_VAR as ENGINE_KEY_VAR
from hgxserve.base.paths import CREDENTIALS_DIR
from hgxserve.topology.model import Engine, SecretRef, Topology
from hgxserve.topology.ports import proxy_targets, setting_path
from hgxserve.topology.problems import JsonPath

# the credential name of the proxy's client key, unless a `credential:` reference names one
API_KEY_CREDENTIAL = "api-key"
# the same for the key the proxy's /metrics wants (proxy.auth.metrics_key)
METRICS_KEY_CREDENTIAL = "metrics-key"


def credential_for(var: str, ref: SecretRef) -> tuple[str, str, str | None]:
    """(credential name, LoadCredential= value, file the release role writes or None)."""
    if ref.kind == "credential":
        return ref.value, ref.value, None
    if ref.kind == "file":
        name = var.lower().replace("_", "-")
        return name, f"{name}:{ref.value}", None
    name = ref.value.lower().replace("_", "-")
    path = f"{CREDENTIALS_DIR}/{name}"
    return name, f"{name}:{path}", path


def proxy_key_credential(
    ref: SecretRef, name: str = API_KEY_CREDENTIAL
) -> tuple[str, str, str | None]:
    """(name, LoadCredential= value, file the release role writes) of the proxy's client key
    (or, with `name` METRICS_KEY_CREDENTIAL, of its /metrics key)."""
    if ref.kind == "credential":
        return ref.value, ref.value, None
    if ref.kind == "file":
        return name, f"{name}:{ref.value}", None
    path = f"{CREDENTIALS_DIR}/{name}"
    return name, f"{name}:{path}", path


def keyed_by_proxy(topo: Topology, engine: Engine) -> bool:
    """Whether the proxy sends `engine` the engines' key (proxy.auth.engine_api_key)."""
    proxy = topo.proxy
    return (
        proxy is not None
        and proxy.engine_api_key is not None
        and engine.name in proxy_targets(topo)
    )


def engine_secret_env(topo: Topology, engine: Engine) -> dict[str, SecretRef]:
    """The engine's secret environment, plus VLLM_API_KEY when the proxy keys its engines
    (rule `engine-api-key` makes sure the engine sets no VLLM_API_KEY of its own). vLLM reads
    it; SGLang gets it as `--api-key` through the key launcher (hgxserve.base.enginekey)."""
    secrets = dict(engine.secret_env)
    proxy = topo.proxy
    if keyed_by_proxy(topo, engine) and proxy is not None and proxy.engine_api_key is not None:
        secrets[ENGINE_KEY_VAR] = proxy.engine_api_key
    return secrets


def route_engines(topo: Topology) -> list[str]:
    """The engines of the proxy's P/D routes, in route order (a name once)."""
    proxy = topo.proxy
    if proxy is None:
        return []
    return list(dict.fromkeys(n for r in proxy.routes for n in (*r.prefill, *r.decode)))


def proxy_protocol(topo: Topology) -> str:
    """The hgxserve proxy's P/D protocol: `sglang` when its P/D engines (else its combined ones)
    are SGLang, else `vllm-nixl`. Combined engines are relayed the same under either; rule
    `proxy-protocol` makes sure the P/D engines are of one kind."""
    proxy = topo.proxy
    names = route_engines(topo) or (list(proxy.combined) if proxy else [])
    kinds = {topo.engines[n].engine for n in names if n in topo.engines}
    return "sglang" if kinds == {"sglang"} else "vllm-nixl"


@dataclass(frozen=True)
class LoadedCredential:
    """One credential a unit on a host loads, and where the topology asks for it."""

    unit: str  # an engine name, or "proxy"
    name: str
    ref: SecretRef
    path: str | None
    at: JsonPath


def host_credentials(topo: Topology, host: str) -> list[LoadedCredential]:
    """Every credential the units on `host` load, in render order: engines, then the proxy."""
    out: list[LoadedCredential] = []
    for engine in topo.engines_on(host):
        own = engine.secret_env
        for var, ref in sorted(engine_secret_env(topo, engine).items()):
            name, _, path = credential_for(var, ref)
            at = (
                setting_path(topo, engine.name, "secret_env", var)
                if var in own
                else ("proxy", "auth", "engine_api_key")
            )
            out.append(LoadedCredential(engine.name, name, ref, path, at))
    proxy = topo.proxy
    if proxy is None or proxy.host != host or proxy.kind != "hgxserve":
        return out
    if proxy.api_key is not None:
        name, _, path = proxy_key_credential(proxy.api_key)
        out.append(
            LoadedCredential("proxy", name, proxy.api_key, path, ("proxy", "auth", "api_key"))
        )
    if proxy.engine_api_key is not None:
        name, _, path = credential_for(ENGINE_KEY_VAR, proxy.engine_api_key)
        at = ("proxy", "auth", "engine_api_key")
        out.append(LoadedCredential("proxy", name, proxy.engine_api_key, path, at))
    if proxy.metrics_key is not None:
        name, _, path = proxy_key_credential(proxy.metrics_key, METRICS_KEY_CREDENTIAL)
        at = ("proxy", "auth", "metrics_key")
        out.append(LoadedCredential("proxy", name, proxy.metrics_key, path, at))
    return out
