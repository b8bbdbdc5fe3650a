"""pyinfra facts about JIT/compile caches: which keys a host holds, and the host facts that go
into a full cache key.

Example:
    >>> host.get_fact(CacheState, root="/var/cache/hgxserve")  # doctest: +SKIP
    {'vllm-0.26.0-h20-8207acaeed1c8efe': {'archive_sha256': 'c0ffee...', ...}}
"""

from __future__ import annotations

import contextlib
import json
import shlex
from typing import Any

from hgxserve.base.cachelayout import DEFAULT_ROOT, RESTORE_MARKER
from hgxserve.base.defaults import ENGINE_USER
from hgxserve.caches.hostfacts import normalize_host_facts, probe_command
from hgxserve.facts.common import Fact, NameList
from hgxserve.parsers.probes import parse_cache_state


class CacheState(Fact):
    """Cache keys present under a root: {key: restore marker (full_key, archive_sha256, ...)}.

    Example:
        >>> host.get_fact(CacheState, root="/var/cache/hgxserve")  # doctest: +SKIP
        {'vllm-0.26.0-h20-8207acaeed1c8efe': {'archive_sha256': 'c0ffee...', ...}}
    """

    empty = {}

    def command(self, root: str = DEFAULT_ROOT) -> str:
        pattern = shlex.quote(root.rstrip("/")) + "/*/" + RESTORE_MARKER
        return (
            f'for f in {pattern}; do [ -f "$f" ] || continue; '
            'printf "##%s\\n" "$f"; cat "$f"; echo; done; true'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        return parse_cache_state(output)


class CacheNotOwned(NameList):
    """Cache keys under a root holding anything `user` does not own (all of them while the
    user does not exist yet): their engines, which run as `user`, could not write there.

    Example:
        >>> host.get_fact(CacheNotOwned, root="/var/cache/hgxserve", user="hgxserve-engine")
        ... # doctest: +SKIP
        ['vllm-0.26.0-h20-8207acaeed1c8efe']
    """

    def command(self, root: str = DEFAULT_ROOT, user: str = ENGINE_USER) -> str:
        keys = shlex.quote(root.rstrip("/")) + "/*/"
        who = shlex.quote(user)
        return (
            f"if id -u {who} >/dev/null 2>&1; then "
            f'for d in {keys}; do [ -d "$d" ] || continue; '
            f'[ -z "$(find "$d" ! -user {who} \\( -type d -o -links 1 \\) -print -quit)" ] '
            '|| basename "$d"; done; '
            f'else for d in {keys}; do [ -d "$d" ] && basename "$d"; done; fi; true'
        )


class CacheKeyFacts(Fact):
    """The host facts that go into the full cache key, probed with the engine's own Python.

    Example:
        >>> host.get_fact(CacheKeyFacts, python="/opt/vllm/bin/python", engine="vllm",
        ...               manifest="/models/M/hgxserve-manifest.json")  # doctest: +SKIP
        {'driver_version': '570.158.01', 'engine_version': '0.26.0', ...}
    """

    empty = {}

    def command(self, python: str, engine: str, manifest: str = "") -> str:
        probe = " ".join(shlex.quote(a) for a in probe_command(python, engine))
        digest = ""
        if manifest:
            m = shlex.quote(manifest)
            digest = f'; [ -f {m} ] && echo "##manifest $(sha256sum {m} | cut -d" " -f1)"'
        return f"if [ -x {shlex.quote(python)} ]; then {probe}; else echo '{{}}'; fi{digest}; true"

    def process(self, output: list[str]) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        for line in output:
            if line.startswith("##manifest "):
                facts["model_manifest_sha256"] = line.split()[1]
            elif line.startswith("{"):
                with contextlib.suppress(ValueError):
                    facts.update(json.loads(line))
        return normalize_host_facts(facts)
