"""Rules on secrets and credentials: secret-env, credential-names, engine-api-key.

No secret values in env or extra_args; on each host one credential name stands for one secret;
proxy.auth.engine_api_key keys only vLLM engines without a key of their own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, cast

from hgxserve.base.paths import CONFIG_DIR
from hgxserve.topology.engine_args import EngineKind
from hgxserve.topology.engine_flags import read_extra_args
from hgxserve.topology.model import Engine, Topology
from hgxserve.topology.ports import setting_path
from hgxserve.topology.registry import Finding, engine_rule, rule
from hgxserve.topology.wiring import (
    ENGINE_KEY_VAR,
    LoadedCredential,
    host_credentials,
    keyed_by_proxy,
)

FAMILY = ("secret-env", "credential-names", "engine-api-key")


# Words that mark a name as holding a secret (words, not substrings: TOKENIZERS_PARALLELISM is
# not a token). TOKEN and KEY also name counts and sizes: followed by one of _QUANTITY_WORDS they
# do not count (vLLM's VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD and
# VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD are token counts, vllm/envs.py). SECRET, PASSWORD and
# CREDENTIAL always count; so does a TOKEN or KEY followed by anything else (HF_TOKEN,
# HF_TOKEN_2, API_KEY_PROD).
_SECRET_WORDS = {"SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
_SECRET_IF_NOT_COUNTED = {"KEY", "KEYS", "APIKEY", "TOKEN"}
_QUANTITY_WORDS = {
    "THRESHOLD",
    "THRESHOLDS",
    "LIMIT",
    "BUDGET",
    "COUNT",
    "NUM",
    "SIZE",
    "LEN",
    "LENGTH",
    "MAX",
    "MIN",
    "RATIO",
    "PER",
    "INTERVAL",
    "SECONDS",
    "SECS",
    "MS",
    "TIMEOUT",
    "RATE",
    "USAGE",
    "IDS",
}
# words that mark a variable holding a location or a switch, not the secret itself
_NOT_SECRET_WORDS = {"FILE", "PATH", "DIR", "ID", "ENABLE", "ENABLED", "DISABLE"}
_SECRET_FLAGS = ("--api-key", "--hf-token")


def _secret_key(key: str) -> bool:
    """Whether an env name looks like it holds a secret.

    >>> [_secret_key(k) for k in ("HF_TOKEN", "VLLM_API_KEY", "AWS_SECRET_ACCESS_KEY",
    ...     "HF_TOKEN_2")]
    [True, True, True, True]
    >>> [_secret_key(k) for k in ("TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH",
    ...     "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD", "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE")]
    [False, False, False, False]
    """
    words = [w for w in re.split(r"[^A-Za-z0-9]+", key.upper()) if w]
    if set(words) & _NOT_SECRET_WORDS:
        return False
    if set(words) & _SECRET_WORDS:
        return True
    return any(
        word in _SECRET_IF_NOT_COUNTED
        and (i + 1 == len(words) or words[i + 1] not in _QUANTITY_WORDS)
        for i, word in enumerate(words)
    )


@rule(
    "secret-env",
    "error",
    "No secret values in env or extra_args; use secret_env references.",
    why=(
        "env values land in unit files, `systemctl show` and logs. A name is secret-looking "
        "when it holds the word SECRET, PASSWORD or CREDENTIAL(S), or KEY, KEYS or TOKEN not "
        "followed by a count word (THRESHOLD, LIMIT, BUDGET, COUNT, NUM, SIZE, LEN, MAX, "
        "MIN, RATIO, PER, INTERVAL, SECONDS, MS, TIMEOUT, RATE, USAGE, IDS); FILE, PATH, "
        "DIR, ID, ENABLE mark a location or switch. `HF_TOKEN_2` is refused, vLLM's "
        "`VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD` (a token count) passes"
    ),
)
def secret_env(topo: Topology) -> Iterator[Finding]:
    places: list[tuple[tuple[str, ...], dict[str, Any], list[Any]]] = []
    defaults = topo.raw.get("defaults", {})
    places.append((("defaults",), defaults.get("env", {}), defaults.get("extra_args", [])))
    for name, data in topo.raw.get("engines", {}).items():
        places.append((("engines", name), data.get("env", {}), data.get("extra_args", [])))
    for base, env, extra in places:
        for key, value in env.items():
            if _secret_key(key) and str(value) != "":
                yield (
                    (*base, "env", key),
                    f"env {key} looks like a secret: a value here lands in the unit file and "
                    f"`systemctl show`; use secret_env with a reference, e.g. secret_env: "
                    f"{{{key}: {{env: {key}}}}} or {{file: {CONFIG_DIR}/{key.lower()}}}",
                )
        for i, flag in _secret_flags(extra):
            yield (
                (*base, "extra_args", i),
                f"{flag} puts a secret on the command line (visible in ps "
                "and the unit); use secret_env with a reference (e.g. VLLM_API_KEY: "
                "{env: VLLM_API_KEY}) or proxy.auth",
            )


def _secret_flags(extra: list[Any]) -> list[tuple[int, str]]:
    """(index, flag as written) of each secret flag in extra_args, in any spelling either
    engine's parser takes for it (`--api_key`, a prefix such as `--hf-tok`)."""
    hits: dict[int, str] = {}
    for engine in ("vllm", "sglang"):
        for found in read_extra_args(cast(EngineKind, engine), extra):
            if {found.written, found.name, found.flag} & set(_SECRET_FLAGS):
                hits.setdefault(found.index, found.written)
    return sorted(hits.items())


def _shown(cred: LoadedCredential) -> str:
    who = "the proxy" if cred.unit == "proxy" else cred.unit
    return f"{cred.ref.kind}:{cred.ref.value} for {who}"


@rule(
    "credential-names",
    "error",
    "On each host one credential name stands for one secret (units load them by name).",
    why=(
        "two secrets under one LoadCredential= name: one unit would read the other's secret "
        "(the renderer refused it at deploy time)"
    ),
)
def credential_names(topo: Topology) -> Iterator[Finding]:
    for host in topo.hosts_in_use():
        first: dict[str, LoadedCredential] = {}
        for cred in host_credentials(topo, host):
            known = first.setdefault(cred.name, cred)
            if known is cred or (known.ref == cred.ref and known.path == cred.path):
                continue
            yield (
                cred.at,
                f"on {host} the credential name '{cred.name}' would stand for two secrets "
                f"({_shown(known)} and {_shown(cred)}): units load credentials by name, so one "
                "would read the other's secret; rename one (a different variable, or a "
                "credential: reference with its own name)",
            )


@engine_rule(
    "engine-api-key",
    "error",
    "proxy.auth.engine_api_key keys engines that set no VLLM_API_KEY of their own.",
    why=(
        "a second VLLM_API_KEY would replace the proxy's (vLLM reads it; a keyed SGLang "
        "engine's launcher turns it into --api-key in memory)"
    ),
)
def engine_api_key(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if not keyed_by_proxy(topo, engine):
        return
    for section in ("secret_env", "env"):
        if ENGINE_KEY_VAR in getattr(engine, section):
            yield (
                setting_path(topo, engine.name, section, ENGINE_KEY_VAR),
                f"{ENGINE_KEY_VAR} of {engine.name} is set here and by "
                "proxy.auth.engine_api_key; set it in one place (proxy.auth.engine_api_key)",
            )
