"""Rules on code a topology makes the engines run: remote-code-*, args-load-code, package-known.

trust_remote_code only with verified, pinned weights; engine flags that import code the
topology names, and runtime packages other than the kernels and transfer extras hgxserve knows,
only where `accept:` names the finding by its path (hgxserve.topology.rules.common).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from hgxserve.topology.kernels import KERNELS
from hgxserve.topology.model import Engine, Topology, normalize_dist
from hgxserve.topology.ports import setting_path
from hgxserve.topology.problems import JsonPath
from hgxserve.topology.registry import Finding, engine_rule
from hgxserve.topology.rules.common import accept_hint, extra_flags

FAMILY = ("remote-code-", "args-load-code", "package-known")


@engine_rule(
    "remote-code-integrity",
    "error",
    "trust_remote_code runs Python from the model tree: only with sha256-verified weights.",
    why=(
        "with `model.integrity: size-etag` nothing proves the code is the published one "
        "(docs/security.md)"
    ),
)
def remote_code_integrity(topo: Topology, engine: Engine) -> Iterator[Finding]:
    if topo.model.integrity == "sha256":
        return
    if engine.args.get("trust_remote_code"):
        yield (
            setting_path(topo, engine.name, "args", "trust_remote_code"),
            "trust_remote_code runs Python from the model tree inside the engine; "
            "with model.integrity: size-etag nothing proves those files are the published "
            "ones: publish a manifest and drop the opt-out, or turn trust_remote_code off",
        )


@engine_rule(
    "remote-code-pin",
    "error",
    "trust_remote_code needs pinned weights: model.digest, or digest_from: inventory.",
    why=(
        "unpinned, the bucket's own manifest is the trust root: bucket write access would be "
        'code execution on every host (docs/weights.md "Trust root")'
    ),
)
def remote_code_pin(topo: Topology, engine: Engine) -> Iterator[Finding]:
    model = topo.model
    if model.integrity != "sha256" or model.digest or model.digest_from == "inventory":
        return  # the opt-out is rule remote-code-integrity's
    if engine.args.get("trust_remote_code"):
        yield (
            setting_path(topo, engine.name, "args", "trust_remote_code"),
            "trust_remote_code runs Python from the model tree, and without a pin the weights "
            "are verified only against the bucket's own manifest: whoever can write the bucket "
            "runs code on every host; pin the manifest digest (model.digest: sha256:..., from "
            "`hgxserve weights manifest SRC`) or keep the pin in the inventory's pins file "
            "(model.digest_from: inventory)",
        )


# Engine flags whose value is code to import (a class or module path), a file that can name code
# or more flags past these rules, or that let requests carry code or read the host's files
# (SGLang's custom logit processors arrive serialized in the request). extra_args are matched as
# the engine's parser reads them (hgxserve.topology.engine_flags: `_` or `-`, any prefix).
CODE_FLAGS = {
    "--worker-extension-cls": "imports the named class into every worker",
    "--worker-cls": "imports the named worker class",
    "--scheduler-cls": "imports the named scheduler class",
    "--logits-processors": "imports the named logits processor classes",
    "--middleware": "imports the named ASGI middleware into the API server",
    "--tool-parser-plugin": "executes the named Python file",
    "--reasoning-parser-plugin": "executes the named Python file",
    "--enable-custom-logit-processor": "runs logit processors that requests send serialized",
    "--custom-weight-loader": "imports the named weight loader functions",
    "--config": "reads more flags from a YAML file, which no rule sees",
    "--log-config-file": (
        "loads a logging dictConfig, which can construct any callable (`()`: module.factory)"
    ),
    "--logging-config": (
        "configures logging from a file or dictConfig, which can construct any callable"
    ),
    "--allowed-local-media-path": (
        "lets every request read the host's files under that path (file:// media URLs)"
    ),
}
# Packages a runtime may add without an accept: the kernels hgxserve knows (their preflight
# imports them) and the P/D transfer extras (hgxserve.runtime.spec.KV_EXTRAS).
KV_EXTRA_DISTS = ("nixl", "mooncake-transfer-engine")
SUBKEY_LOADS = (
    "sets one key of a JSON config flag, past the typed fields and the rules that check them "
    "(a key such as kv_connector_module_path or an inductor pass names code to import)"
)


# Keys of a JSON config flag's value that name code to import or run (KVTransferConfig's and
# ECTransferConfig's *_connector_module_path, CompilationConfig's inductor passes, a
# dictConfig's `()` factory, class and plugin names).
CODE_KEY = re.compile(r"(module_path|module|_cls|_class|class|passes|pass|plugins?|factory|\(\))$")


def _code_keys(value: str) -> list[str]:
    """The keys of a JSON object (at any depth) that name code, for a config flag's value."""
    try:
        data = json.loads(value)
    except ValueError:
        return []
    found: list[str] = []
    todo = [data]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            found += [str(k) for k in item if CODE_KEY.search(str(k))]
            todo += list(item.values())
        elif isinstance(item, list):
            todo += item
    return sorted(set(found))


def _code_flags(topo: Topology, engine: Engine) -> Iterator[tuple[JsonPath, str, str]]:
    """(path, what, why) of each extra arg that names code, where the user wrote it."""
    for path, flag in extra_flags(topo, engine):
        keys = _code_keys(flag.value) if (flag.flag or "").endswith("-config") else []
        if flag.subkey:
            yield path, f"{flag.written}={flag.value}".rstrip("="), SUBKEY_LOADS
        elif keys:
            yield (
                path,
                flag.written,
                (f"sets {', '.join(keys)} in its JSON value, which names code to import"),
            )
        elif flag.flag in CODE_FLAGS:
            spelled = (
                "" if flag.written == flag.flag else f" ({engine.engine} reads it as {flag.flag})"
            )
            yield path, f"{flag.written}{spelled} {flag.value}".strip(), CODE_FLAGS[flag.flag]


@engine_rule(
    "args-load-code",
    "error",
    "No engine flag that imports code the topology names (--worker-extension-cls, "
    "--middleware, --config, a logging config, a dotted sub-key, ...), in any spelling the "
    "engine takes, unless accepted by its path.",
    why=(
        "--worker-extension-cls, --middleware, --tool-parser-plugin and the like import code "
        "by name, --config and a dictConfig bring in what no rule saw; SGLang's "
        "--enable-custom-logit-processor runs code that requests carry"
    ),
)
def args_load_code(topo: Topology, engine: Engine) -> Iterator[Finding]:
    for path, what, why in _code_flags(topo, engine):
        yield path, f"{what} {why}; {accept_hint(path)}"


def _known_dists() -> set[str]:
    return {d for k in KERNELS.values() for d in k.dists} | set(KV_EXTRA_DISTS)


@engine_rule(
    "package-known",
    "error",
    "runtime.packages holds the kernels and transfer extras hgxserve knows; any other "
    "package is accepted by its path.",
    why=(
        "a package's code runs in every engine process; the kernels and transfer extras are "
        "the ones preflight checks and the docs describe"
    ),
)
def package_known(topo: Topology, engine: Engine) -> Iterator[Finding]:
    runtime = engine.runtime
    if runtime is None or not runtime.packages:
        return
    known = _known_dists()
    for i, pin in enumerate(runtime.packages):
        if normalize_dist(pin.split("==", 1)[0]) in known:
            continue
        path = _package_path(topo, engine, i)
        yield (
            path,
            f"{pin} is not a kernel or transfer package hgxserve knows ({', '.join(sorted(known))}"
            f"): its code runs in every engine process; {accept_hint(path)}",
        )


def _package_path(topo: Topology, engine: Engine, index: int) -> JsonPath:
    base = setting_path(topo, engine.name, "runtime", "packages")
    return (*base, index) if base[-1] == "packages" else base
