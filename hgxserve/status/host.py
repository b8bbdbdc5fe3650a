"""`hgxserve inspect`: everything `hgxserve status` shows about this host, as one JSON document.

Read-only: it reads the release store, asks systemd, nvidia-smi and the local HTTP endpoints of
the units (health, metrics), and stats the weights and cache directories; it never starts, stops
or writes anything. The controller runs it over SSH on every host at once, so a whole lab costs
about one SSH round trip. Imports stay light (no pyinfra, no boto3): it runs on every refresh.

    hgxserve inspect --model-path /models/tiny --cache-root /var/cache/hgxserve \
        --cache-key vllm-unversioned-h200-9b0f3c1d2e4a6b8c
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hgxserve import __version__
from hgxserve.base.cachelayout import BAKE_RECORD, read_marker, valid_key
from hgxserve.base.paths import CACHE_ROOT, RELEASE_ROOT
from hgxserve.base.promtext import parse_samples
from hgxserve.parsers import outputs as parsers
from hgxserve.proxy.scrape import metrics_headers
from hgxserve.release.store import ReleaseError, ReleaseSpec, Store
from hgxserve.release.switch import DEADMAN_UNIT

# bounds, so one hung tool (a GPU in a bad state makes nvidia-smi hang) cannot stall the view
HTTP_TIMEOUT_S = 2.0
NVIDIA_SMI_TIMEOUT_S = 15.0
SYSTEMCTL_TIMEOUT_S = 10.0
UNIT_PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "NRestarts",
    "MainPID",
    "ExecMainStatus",
    "NeedDaemonReload",
    "ActiveEnterTimestamp",
    "InactiveEnterTimestamp",
    "StateChangeTimestamp",
)
# engine metrics worth showing: KV transfer evidence (vLLM NIXL, SGLang disaggregation) and load
ENGINE_COUNTERS = {
    "vllm:nixl_xfer_time_seconds_count": "kv_transfers",
    "vllm:nixl_num_failed_transfers_total": "kv_failed",
    "sglang:num_transfer_failed_reqs_total": "kv_failed",
    "sglang:num_bootstrap_failed_reqs_total": "kv_failed",
    "sglang:kv_transfer_latency_ms_count": "kv_transfers",
    "vllm:num_requests_running": "running",
    "sglang:num_running_reqs": "running",
    "vllm:num_requests_waiting": "waiting",
    "sglang:num_queue_reqs": "waiting",
}
PROXY_PREFIX = "hgxserve_proxy_"


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr); 127 when the tool is missing, 124 when it hung."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: no answer within {timeout:g} s"
    return proc.returncode, proc.stdout + (proc.stderr if proc.returncode else "")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int | None, str]:
    """(HTTP status or None when nothing answered, body or the connection error)."""
    try:
        req = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")[:300]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, str(getattr(reason, "strerror", None) or reason)


def _base(url: str) -> str:
    """`http://127.0.0.1:8100/health` -> `http://127.0.0.1:8100`."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


# ------------------------------------------------------------------------------- systemd


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show -p ... UNIT...` output -> {unit id: {property: value}}."""
    units: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Id"):
            units[props["Id"]] = props
    return units


def _timestamp(value: str | None) -> float | None:
    """`@1701330663` (systemctl --timestamp=unix) -> 1701330663.0; empty/n/a -> None."""
    if value and value.startswith("@"):
        try:
            stamp = float(value[1:])
        except ValueError:
            return None
        return stamp or None
    return None


def unit_states(names: list[str]) -> dict[str, dict[str, Any]]:
    """State of each unit: active/sub state, result, restarts, since, main PID, reload needed."""
    if not names:
        return {}
    argv = ["systemctl", "show", "--timestamp=unix", "-p", ",".join(UNIT_PROPERTIES), "--", *names]
    rc, out = _run(argv, SYSTEMCTL_TIMEOUT_S)
    shown = parse_show(out) if rc == 0 else {}
    states = {}
    for name in names:
        props = shown.get(name, {})
        active = props.get("ActiveState", "unknown")
        states[name] = {
            "loaded": props.get("LoadState", "unknown"),
            "active": active,
            "sub": props.get("SubState", ""),
            "result": props.get("Result", ""),
            "restarts": int(props.get("NRestarts") or 0),
            "main_pid": int(props.get("MainPID") or 0) or None,
            "exit_status": int(props.get("ExecMainStatus") or 0),
            "need_reload": props.get("NeedDaemonReload") == "yes",
            "since": _timestamp(props.get("ActiveEnterTimestamp"))
            if active == "active"
            else _timestamp(props.get("InactiveEnterTimestamp"))
            or _timestamp(props.get("StateChangeTimestamp")),
        }
        if rc != 0:
            states[name]["error"] = out.strip()[:300]
    return states


def running_hgxserve_units() -> dict[str, str]:
    """Every loaded hgxserve-*.service -> its active state (release helpers left out)."""
    rc, out = _run(
        ["systemctl", "list-units", "hgxserve-*.service", "--all", "--plain", "--no-legend"],
        SYSTEMCTL_TIMEOUT_S,
    )
    units = {}
    for line in out.splitlines() if rc == 0 else []:
        parts = line.split()
        if len(parts) >= 3 and not parts[0].startswith("hgxserve-release-"):
            units[parts[0]] = parts[2]
    return units


def deadman_timer() -> dict[str, Any]:
    """The dead-man timer that reverts a pending switch: armed or not, and when it fires."""
    rc, out = _run(
        [
            "systemctl",
            "show",
            "--timestamp=unix",
            "-p",
            "Id,ActiveState,NextElapseUSecRealtime,NextElapseUSecMonotonic,LastTriggerUSec",
            f"{DEADMAN_UNIT}.timer",
        ],
        SYSTEMCTL_TIMEOUT_S,
    )
    props = parse_show(out).get(f"{DEADMAN_UNIT}.timer", {}) if rc == 0 else {}
    fires = _timestamp(props.get("NextElapseUSecRealtime"))
    return {"armed": props.get("ActiveState") == "active", "fires_at": fires}


def cgroup_unit(pid: int) -> str | None:
    """The systemd service a process runs in (from /proc/PID/cgroup), or the scope (a container
    runtime's `libpod-<id>.scope`) when it is in no service; None when unknown."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return None
    scope = None
    for line in text.splitlines():
        for part in reversed(line.rsplit(":", 1)[-1].split("/")):
            if part.endswith(".service"):
                return part
            if part.endswith(".scope") and scope is None:
                scope = part
    return scope


# ------------------------------------------------------------------------------- parts


def release_part(store: Store) -> tuple[dict[str, Any], ReleaseSpec | None]:
    """Links, pending switch (with its deadline), staged ids; and the spec of what runs now."""
    status = store.status()
    pending = status.get("pending")
    running = (pending or {}).get("id") or status.get("current")
    spec = None
    error = None
    if running:
        try:
            spec = store.load(running)
        except (ReleaseError, ValueError, TypeError, KeyError) as exc:
            error = str(exc)
    part = {**status, "running": running, "error": error}
    if spec is not None:
        part["topology"] = spec.topology
        part["topology_digest"] = spec.topology_digest
    if pending:
        part["deadman"] = deadman_timer()
    return part, spec


def drift_part(store: Store, spec: ReleaseSpec | None, loaded: dict[str, str]) -> dict[str, Any]:
    """What runs differs from the release: changed or missing installed files, hgxserve units
    that run but are not in the release."""
    modified, missing = [], []
    if spec is not None:
        tree = store.release_dir(spec.id) / "tree"
        for path in sorted(spec.files):
            try:
                with open(path, "rb") as fh:
                    installed = fh.read()
            except OSError:
                missing.append(path)
                continue
            try:
                wanted = (tree / path.lstrip("/")).read_bytes()
            except OSError:
                continue  # the release's own copy is gone; `release` reports that
            if installed != wanted:
                modified.append(path)
    known = set(spec.unit_names) if spec else set()
    stray = sorted(
        name for name, active in loaded.items() if name not in known and active == "active"
    )
    return {"modified": modified, "missing": missing, "stray_units": stray}


def gpu_part() -> dict[str, Any]:
    """Per GPU: memory used/total, utilisation, and the processes on it with their unit."""
    rc, out = _run(["nvidia-smi"], NVIDIA_SMI_TIMEOUT_S)
    if rc == 127:
        return {"status": "absent", "gpus": []}
    if rc != 0:
        return {"status": "error", "error": out.strip()[:500], "gpus": []}
    try:
        table = parsers.parse_smi_table(out)
    except ValueError as exc:
        return {"status": "error", "error": f"unreadable nvidia-smi table: {exc}", "gpus": []}
    procs: dict[int, list[dict[str, Any]]] = {}
    for proc in table["processes"]:
        procs.setdefault(proc["gpu"], []).append(
            {
                "pid": proc["pid"],
                "name": proc["name"],
                "used_memory_mib": proc["used_memory_mib"],
                "unit": cgroup_unit(proc["pid"]),
            }
        )
    gpus = [
        {
            "index": gpu["index"],
            "name": gpu["name"],
            "memory_used_mib": gpu["memory_used_mib"],
            "memory_total_mib": gpu["memory_total_mib"],
            "utilization": gpu["utilization"],
            "processes": procs.get(gpu["index"], []),
        }
        for gpu in table["gpus"]
    ]
    return {"status": "ok", "driver_version": table["driver_version"], "gpus": gpus}


def weights_part(model_path: str, state_dir: str | None) -> dict[str, Any]:
    """The verified marker of the model tree and whether the tree still matches it."""
    from hgxserve.weights.state import State, check_marker, read_marker, state_dir_for

    directory = state_dir_for(model_path, state_dir)
    ok, why = check_marker(model_path, state_dir, None)
    return {
        "path": model_path,
        "state_dir": directory,
        "marker": read_marker(directory),
        "source": State.load(directory).source,
        "intact": ok,
        "detail": why,
    }


def cache_part(root: str, keys: list[str]) -> dict[str, Any]:
    """Per cache key: whether its directory exists, was restored (marker) or baked here."""
    out: dict[str, Any] = {}
    for key in keys:
        if not valid_key(key):
            out[key] = {"error": "not a cache key"}
            continue
        directory = os.path.join(root, key)
        marker = read_marker(directory)
        out[key] = {
            "present": os.path.isdir(directory),
            "restored": (marker or {}).get("archive") or bool(marker),
            "baked": os.path.exists(os.path.join(directory, BAKE_RECORD)),
        }
    return out


def engine_metrics(url: str) -> dict[str, Any]:
    """KV transfer counters and queue lengths from an engine's /metrics."""
    status, text = _get(_base(url) + "/metrics")
    if status != 200:
        return {"error": f"HTTP {status}" if status else text}
    found: dict[str, float] = {}
    for name, _, value in parse_samples(text):
        key = ENGINE_COUNTERS.get(name)
        if key:
            found[key] = found.get(key, 0.0) + value
    return found


def proxy_part(url: str) -> dict[str, Any]:
    """The proxy's view from its /metrics: each engine in/out of rotation and why, outstanding
    requests, KV hand-offs, upstream errors, since when it runs (with the /metrics key its
    proxy.json names, when it names one)."""
    status, text = _get(_base(url) + "/metrics", metrics_headers())
    if status != 200:
        return {"url": _base(url), "error": f"HTTP {status}" if status else text}
    return {"url": _base(url), **parse_proxy_metrics(text)}


# an engine's proxy metric -> (its key in the instance entry, its value from labels and value)
_INSTANCE_FIELDS: dict[str, tuple[str, Callable[[dict[str, str], float], Any]]] = {
    "instance_healthy": ("in_rotation", lambda labels, value: value == 1),
    "instance_out_of_rotation": ("reason", lambda labels, value: labels.get("reason", "")),
    "instance_state_since_seconds": ("since", lambda labels, value: value),
    "outstanding_requests": ("outstanding", lambda labels, value: int(value)),
}


def parse_proxy_metrics(text: str) -> dict[str, Any]:
    """The proxy's /metrics text -> instances (in rotation, why not, since, outstanding,
    upstream errors), KV hand-offs by result, routing decisions by route/reason, start time."""
    instances: dict[str, dict[str, Any]] = {}
    handoffs: dict[str, float] = {}
    decisions: dict[str, float] = {}
    errors: dict[str, float] = {}
    started = None
    for name, labels, value in parse_samples(text):
        if not name.startswith(PROXY_PREFIX):
            continue
        metric = name[len(PROXY_PREFIX) :]
        inst = labels.get("instance")
        if inst is not None and metric.startswith(("instance_", "outstanding")):
            entry = instances.setdefault(inst, {"url": inst, "role": labels.get("role")})
            if metric in _INSTANCE_FIELDS:
                key, read = _INSTANCE_FIELDS[metric]
                entry[key] = read(labels, value)
        elif metric == "kv_handoffs_total":
            handoffs[labels.get("result", "")] = value
        elif metric == "route_decisions_total":
            decisions[f"{labels.get('route', '')}/{labels.get('reason', '')}"] = value
        elif metric == "upstream_errors_total" and inst:
            errors[inst] = errors.get(inst, 0.0) + value
        elif metric == "start_time_seconds":
            started = value
    for inst, count in errors.items():
        instances.setdefault(inst, {"url": inst})["upstream_errors"] = int(count)
    return {
        "known": bool(instances) or started is not None,  # hgxserve's own proxy
        "started": started,
        "instances": sorted(instances.values(), key=lambda i: i["url"]),
        "kv_handoffs": {k: int(v) for k, v in sorted(handoffs.items())},
        # routing decisions by route/reason (docs/proxy.md "KV-aware routing")
        "decisions": {k: int(v) for k, v in sorted(decisions.items())},
    }


def watch_summary(body: str) -> dict[str, Any]:
    """A multi-node engine's watcher from its GET /state (hgxserve.release.watch): its role,
    generation, restarts, phase and last events."""
    try:
        state = json.loads(body)
    except ValueError:
        return {"error": "GET /state did not answer JSON"}
    if not isinstance(state, dict):
        return {"error": "GET /state did not answer an object"}
    keys = ("role", "generation", "restarts", "phase", "unit_state", "hosts")
    return {
        **{k: state.get(k) for k in keys},
        "events": list(state.get("events") or [])[-5:],
    }


# ------------------------------------------------------------------------------- snapshot


def snapshot(
    *,
    root: str = RELEASE_ROOT,
    model_path: str | None = None,
    weights_state_dir: str | None = None,
    cache_root: str = CACHE_ROOT,
    cache_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """This host's state as `hgxserve status` reads it (see the module docstring)."""
    started = time.monotonic()
    store = Store(root)
    release, spec = release_part(store)
    units = spec.units if spec else []
    with ThreadPoolExecutor(max_workers=8) as pool:
        gpus = pool.submit(gpu_part)
        loaded = pool.submit(running_hgxserve_units)
        states = pool.submit(unit_states, [u.name for u in units])
        health = {
            u.name: pool.submit(_get, u.health_url) for u in units if u.health_url is not None
        }
        metrics = {
            u.name: pool.submit(engine_metrics, u.health_url)
            for u in units
            if u.health_url is not None and u.kind == "engine"
        }
        proxy = next(
            (pool.submit(proxy_part, u.health_url) for u in units if u.kind == "proxy" and
             u.health_url), None,
        )  # fmt: skip
        weights = pool.submit(weights_part, model_path, weights_state_dir) if model_path else None
        caches = pool.submit(cache_part, cache_root, list(cache_keys))
        observed = store.observed(spec.id) if spec else {}
        unit_list = []
        for unit in units:
            entry: dict[str, Any] = {
                "name": unit.name,
                "kind": unit.kind,
                "gpus": unit.gpus,
                "health_url": unit.health_url,
                **states.result().get(unit.name, {}),
            }
            if unit.name in health:
                code, body = health[unit.name].result()
                entry["health"] = "ok" if code == 200 else "failing"
                entry["health_detail"] = (
                    f"HTTP {code}" if code is not None else body
                ) if code != 200 else ""  # fmt: skip
                if unit.kind == "watch" and code == 200:
                    entry["watch"] = watch_summary(body)
            if unit.name in metrics:
                entry["metrics"] = metrics[unit.name].result()
            if unit.name in observed:  # start time and KV capacity (hgxserve.release.kvcap)
                entry["observed"] = observed[unit.name]
            unit_list.append(entry)
        result = {
            "host": socket.gethostname(),
            "agent_version": __version__,
            "time": time.time(),
            "release": release,
            "units": unit_list,
            "drift": drift_part(store, spec, loaded.result()),
            "gpus": gpus.result(),
            "weights": weights.result() if weights else None,
            "caches": caches.result(),
            "proxy": proxy.result() if proxy else None,
        }
    result["elapsed_s"] = round(time.monotonic() - started, 3)
    return result
