"""Reading the proxy's own /metrics on its host (a drain, `hgxserve status`): with the key its
proxy.json names (`auth.metrics_key_file`, the unit's credential), when it names one.

    headers = metrics_headers()     # {} when /metrics is open or the key cannot be read
    urllib.request.Request(url + "/metrics", headers=headers)

The key file lives in the running unit's credentials directory (/run/credentials/...), which
root reads; the agent that drains and reports runs as root on the proxy's host.
"""

from __future__ import annotations

from pathlib import Path

from hgxserve.base.paths import PROXY_CONFIG
from hgxserve.proxy.config import ProxyConfigError, load_proxy_config, read_api_key


def metrics_headers(config_path: str | Path = PROXY_CONFIG) -> dict[str, str]:
    """The Authorization header the proxy configured by `config_path` wants on /metrics; {}
    when it wants none, or when the configuration or key cannot be read (the read then gets
    401, which its caller reports as it reports any unreadable /metrics)."""
    try:
        key_file = load_proxy_config(config_path).metrics_key_file
        if key_file is None:
            return {}
        return {"Authorization": f"Bearer {read_api_key(key_file)}"}
    except ProxyConfigError:
        return {}
