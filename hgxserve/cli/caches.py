"""`hgxserve cache`: key, facts, bake, pack, restore, scan and state of JIT/compile caches.

Example:
    hgxserve cache key --topology topologies/h20-v4flash-tp8.yml --engine combined-0 \\
        --host h20-a --facts facts.json
    hgxserve cache bake --topology t.yml --engine combined-0 --pack-to /srv/caches/
    hgxserve cache pack --dir /var/cache/hgxserve/<key> --out /srv/caches/
    hgxserve cache restore --archive /srv/caches/<sha256>.tar.zst --dir /var/cache/hgxserve/<key>
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from hgxserve.base.cachelayout import DEFAULT_ROOT
from hgxserve.base.errors import ExitCode, UsageError, cli_errors
from hgxserve.caches.archive import cache_state, mark_packed, pack_dir, restore_archive
from hgxserve.caches.hostfacts import load_facts_file, probe_host_facts
from hgxserve.cli.options import dump_json


def _load(topology: str) -> Any:
    from hgxserve.topology import TopologyError, load_topology

    try:
        return load_topology(topology)
    except TopologyError as exc:
        lines = [p.text() for p in exc.problems] or [str(exc)]
        raise UsageError(f"{topology}: not a valid topology:\n" + "\n".join(lines)) from exc


def _engine_and_host(topo: Any, engine: str, host: str | None) -> tuple[Any, str]:
    if engine not in topo.engines:
        known = ", ".join(topo.engines)
        raise UsageError(f"engine {engine!r} is not in {topo.name} (engines: {known})")
    eng = topo.engines[engine]
    if host is None:
        host = eng.head
    if host not in eng.place:
        raise UsageError(
            f"engine {engine} does not run on host {host!r} (it runs on {', '.join(eng.place)})"
        )
    return eng, host


def _facts(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    return load_facts_file(path)


@click.group()
def cache() -> None:
    """Key, bake, pack, restore and scan JIT/compile caches (vLLM, SGLang, DeepGEMM, ...).

    Example: hgxserve cache key --topology t.yml --engine decode-0 --facts facts.json
    """


@cache.command("key")
@click.option("--topology", "topology", required=True, type=click.Path(dir_okay=False))
@click.option("--engine", required=True, help="Engine name in the topology.")
@click.option("--host", default=None, help="Host the key is for (default: the engine's head).")
@click.option(
    "--facts",
    "facts_path",
    default=None,
    help="Host facts JSON (see docs/caches.md; `hgxserve cache facts` prints one).",
)
@click.option("--json", "as_json", is_flag=True, help="Print key, render key and all inputs.")
@cli_errors
def key_command(
    topology: str, engine: str, host: str | None, facts_path: str | None, as_json: bool
) -> None:
    """Print the cache key of an engine on a host: render-time inputs plus host facts.

    Example: hgxserve cache key --topology t.yml --engine combined-0 --facts facts.json
    """
    from hgxserve.caches.key import cache_key, key_inputs

    topo = _load(topology)
    eng, host = _engine_and_host(topo, engine, host)
    facts = _facts(facts_path)
    full = cache_key(topo, eng, host_facts=facts)
    if not as_json:
        click.echo(full)
        return
    dump_json(
        {
            "key": full,
            "render_key": cache_key(topo, eng),
            "host": host,
            "dir": f"{topo.cache.root}/{cache_key(topo, eng)}",
            "inputs": key_inputs(topo, eng, facts),
        }
    )


@cache.command("facts")
@click.option("--python", "python", default=None, help="The engine runtime's Python.")
@click.option("--engine", "engine_kind", type=click.Choice(["vllm", "sglang"]), default=None)
@click.option("--topology", "topology", default=None, type=click.Path(dir_okay=False))
@click.option("--engine-name", default=None, help="With --topology: engine whose runtime to probe.")
@click.option("--manifest", default=None, help="Model manifest file to hash.")
@cli_errors
def facts_command(
    python: str | None,
    engine_kind: str | None,
    topology: str | None,
    engine_name: str | None,
    manifest: str | None,
) -> None:
    """Print this host's key facts (engine/torch/CUDA/driver versions, GPU name, SMs) as JSON.

    Example: hgxserve cache facts --python /opt/vllm-0.26/bin/python --engine vllm
    """
    if topology:
        topo = _load(topology)
        if not engine_name:
            raise UsageError("--topology needs --engine-name")
        eng, _ = _engine_and_host(topo, engine_name, None)
        if eng.runtime is None or eng.runtime.venv is None:
            raise UsageError(
                f"engine {engine_name}: runs in an image; probe inside it with --python"
            )
        python = python or os.path.join(eng.runtime.venv, "bin", "python")
        engine_kind = engine_kind or eng.engine
        manifest = manifest or os.path.join(topo.model.path, topo.model.manifest)
    if not python or not engine_kind:
        raise UsageError("give --python and --engine, or --topology and --engine-name")
    dump_json(probe_host_facts(python, engine_kind, manifest))


@cache.command("pack")
@click.option("--dir", "src", required=True, help="Cache key directory, <root>/<key>.")
@click.option("--out", required=True, help="Directory for <sha256>.tar.zst, or an archive path.")
@click.option("--key", default=None, help="Full key to record on this host (bake host).")
@click.option("--level", default=3, show_default=True, type=click.IntRange(1, 19))
@cli_errors
def pack_command(src: str, out: str, key: str | None, level: int) -> None:
    """Pack a cache directory into a deterministic, content-addressed tar+zstd archive.

    Example: hgxserve cache pack --dir /var/cache/hgxserve/<key> --out /srv/caches/
    """
    result = pack_dir(src, out, level=level)
    if key:
        mark_packed(src, result, full_key=key)
    dump_json(result.as_dict())


@cache.command("restore")
@click.option("--archive", required=True, help="Archive file (named <sha256>.tar.zst).")
@click.option("--dir", "dest", required=True, help="Cache key directory to restore into.")
@click.option("--sha256", default=None, help="Expected archive sha256 (default: from its name).")
@click.option("--key", "full_key", default=None, help="Full key to record with the restore.")
@click.option("--force", is_flag=True, help="Restore even if this archive is already in place.")
@cli_errors
def restore_command(
    archive: str, dest: str, sha256: str | None, full_key: str | None, force: bool
) -> None:
    """Restore an archive atomically: unpack aside, verify every checksum, then swap in.

    Example: hgxserve cache restore --archive /srv/<sha256>.tar.zst --dir /var/cache/hgxserve/<key>
    """
    result = restore_archive(archive, dest, sha256=sha256, force=force, full_key=full_key)
    dump_json(result.as_dict())


@cache.command("state")
@click.option("--root", default=DEFAULT_ROOT, show_default=True)
@cli_errors
def state_command(root: str) -> None:
    """Print the keys present under the cache root with their archive digests.

    Example: hgxserve cache state --root /var/cache/hgxserve
    """
    dump_json(cache_state(root))


@cache.command("scan")
@click.argument("log", type=click.File("r"))
@cli_errors
def scan_command(log: Any) -> None:
    """List JIT/compile lines in an engine log; exit 1 if there are any (2, 6: errors).

    Example: journalctl -u hgxserve-decode-0 --since "10 min ago" | hgxserve cache scan -
    """
    from hgxserve.caches.logscan import scan

    hits = [h.as_dict() for h in scan(log.read())]
    dump_json(hits)
    if hits:
        sys.exit(ExitCode.FOUND)


@cache.command("bake")
@click.option("--topology", "topology", required=True, type=click.Path(dir_okay=False))
@click.option("--engine", required=True, help="Engine name in the topology.")
@click.option("--host", default=None, help="This host's name (default: the engine's head).")
@click.option("--base-url", default=None, help="Engine URL (default http://127.0.0.1:<port>).")
@click.option("--facts", "facts_path", default=None, help="Host facts JSON for the full key.")
@click.option("--max-rounds", default=4, show_default=True, type=click.IntRange(1, 50))
@click.option("--ready-timeout", default=3600.0, show_default=True, type=float)
@click.option("--stop-timeout", default=120.0, show_default=True, type=float)
@click.option("--log", "log_path", default=None, help="Engine log file (default beside the key).")
@click.option("--no-deep-gemm", is_flag=True, help="SGLang: skip sglang.compile_deep_gemm.")
@click.option("--pack-to", default=None, help="Then pack the cache into this directory.")
@click.option(
    "--user",
    default=None,
    help="Run the engine as this user, as its unit's User= (the deploy: hgxserve-engine).",
)
@cli_errors
def bake_command(  # noqa: PLR0913 - a click command: one parameter per option
    topology: str,
    engine: str,
    host: str | None,
    base_url: str | None,
    facts_path: str | None,
    max_rounds: int,
    ready_timeout: float,
    stop_timeout: float,
    log_path: str | None,
    no_deep_gemm: bool,
    pack_to: str | None,
    user: str | None,
) -> None:
    """Start the engine as its unit would, warm every topology shape until no JIT, stop it.

    Example: hgxserve cache bake --topology t.yml --engine combined-0 --pack-to /srv/caches/
    """
    from hgxserve.render.bake import BakeOptions, bake_engine

    topo = _load(topology)
    eng, host = _engine_and_host(topo, engine, host)
    opts = BakeOptions(
        base_url=base_url,
        host_facts=_facts(facts_path),
        max_rounds=max_rounds,
        ready_timeout=ready_timeout,
        stop_timeout=stop_timeout,
        log_path=log_path,
        compile_deep_gemm=not no_deep_gemm,
        pack_to=pack_to,
        user=user,
    )
    summary = bake_engine(topo, eng, host, opts)
    dump_json(summary)
    if not summary["settled"]:
        click.echo(
            f"warning: JIT still fired after {max_rounds} rounds; see {summary['log']}", err=True
        )
