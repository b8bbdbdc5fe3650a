"""The preflight check that runs inside an engine's container image (pure, no I/O).

An image holds what it holds: the runtime stage loads it by digest and installs nothing into it.
Before anything changes, preflight runs each engine image on its host once, with `--rm
--pull=never`, and asks it two things:

- the fabric (hgxserve.runtime.fabric), when an engine of the image needs the host's HCAs: the
  run carries the engine's `--network host --ipc host --ulimit memlock=-1:-1` and
  `--device /dev/infiniband --cap-add IPC_LOCK`, and lists the HCAs and uverbs nodes it sees;
- the kernels (hgxserve.topology.kernels, the table the venv preflight reads), when an engine of
  the image needs DeepEP, DeepGEMM, NVSHMEM, FlashInfer or FlashMLA: the image's `python3`
  imports each module and prints which failed, with the engine's first CDI GPU, so the driver
  libraries the kernels link (libcuda) are mounted as they are for the engine (and, without the
  fabric, only the engine's `--network host`: no network namespace is set up).

Each finding is one `HOST: FACT: expected X, found Y` line: `container.fabric` for missing HCAs,
`container.kernels` for modules that do not import (a kernel the engine cannot start without
refuses the host; an advised one is a warning).

    >>> image_check_argv("/usr/bin/podman", "r/vllm@sha256:" + "a" * 64, modules=("deep_ep",),
    ...                  gpu=0)[:6]
    ['/usr/bin/podman', 'run', '--rm', '--pull=never', '--device', 'nvidia.com/gpu=0']
"""

from __future__ import annotations

from dataclasses import dataclass

from hgxserve.runtime.fabric import (
    COMMON_RUN_ARGS,
    FABRIC_MARK,
    FABRIC_RUN_ARGS,
    FABRIC_SCRIPT,
    fabric_check_problem,
    fabric_reasons,
)
from hgxserve.topology.kernels import kernel_needs
from hgxserve.topology.model import Engine, Topology

IMPORT_MARK = "hgxserve-import:"
# The arguments the shell gets: the HCAs up to "--", then the modules ("$@" after the shift).
_ARGS = (
    'devs=""; while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do devs="$devs $1"; shift; done; '
    '[ "$#" -gt 0 ] && shift; '
)
# The image's python3 imports each module and prints `MARK MODULE ok` or the exception's first
# line; no single quote inside (the shell passes it in single quotes).
_IMPORTS_PY = "\n".join(
    (
        "import importlib, sys",
        "for name in sys.argv[1:]:",
        "    try:",
        "        importlib.import_module(name)",
        '        said = "ok"',
        "    except BaseException as error:",
        '        said = (type(error).__name__ + ": " + str(error)).splitlines()[0]',
        f'    print("{IMPORT_MARK}", name, said, flush=True)',
    )
)
_IMPORTS = (
    "if command -v python3 >/dev/null 2>&1; then python3 -c '" + _IMPORTS_PY + '\' "$@"; '
    f'else echo "{IMPORT_MARK} - no python3 on the image\'s PATH"; fi'
)


@dataclass(frozen=True)
class KernelImport:
    """A kernel module an image must import, why, and whether the engine needs it to start."""

    module: str
    why: str
    required: bool


@dataclass(frozen=True)
class ImageCheck:
    """What preflight checks inside one image on one host: the fabric (the host's `rdma` HCAs,
    when an engine of the image needs them) and the kernels its engines need; `gpu` is the first
    CDI GPU of those engines on the host (the run mounts the driver's libraries with it)."""

    image: str
    tool: str
    fabric: bool = False
    kernels: tuple[KernelImport, ...] = ()
    gpu: int | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(k.module for k in self.kernels)


def _kernels_of(topo: Topology, engines: list[Engine]) -> tuple[KernelImport, ...]:
    found: dict[str, KernelImport] = {}
    for engine in engines:
        for need in kernel_needs(topo, engine):
            required = need.rule.severity == "error" or need.rule.bundled
            seen = found.get(need.kernel.module)
            if seen is None or (required and not seen.required):
                why = f"{need.kernel.name} for {need.reason}"
                found[need.kernel.module] = KernelImport(need.kernel.module, why, required)
    return tuple(found[m] for m in sorted(found))


def image_checks(topo: Topology, host: str) -> list[ImageCheck]:
    """One ImageCheck per container engine image on `host` whose engines need the fabric or
    kernels (sorted by image); images that need neither are not run."""
    by_image: dict[tuple[str, str], list[Engine]] = {}
    for engine in topo.engines_on(host):
        runtime = engine.runtime
        if runtime is not None and runtime.image:
            by_image.setdefault((runtime.image, runtime.tool or "podman"), []).append(engine)
    checks = []
    for (image, tool), engines in sorted(by_image.items()):
        fabric = any(fabric_reasons(topo, e, host) for e in engines)
        kernels = _kernels_of(topo, engines)
        if fabric or kernels:
            gpu = min((min(e.place[host]) for e in engines if e.place.get(host)), default=None)
            checks.append(ImageCheck(image, tool, fabric, kernels, gpu))
    return checks


def image_check_argv(
    tool: str,
    image: str,
    devices: tuple[str, ...] = (),
    modules: tuple[str, ...] = (),
    gpu: int | None = None,
) -> list[str]:
    """`podman|docker run --rm --pull=never` of `image` printing the HCAs it sees (when
    `devices` are expected: it then runs with the engine's fabric flags) and which `modules`
    import with its python3 (with CDI GPU `gpu`). Never pulls, changes nothing on the host."""
    # importing needs no IPC or locked memory; the host's network, as the engine's, sets none up
    options = [*COMMON_RUN_ARGS, *FABRIC_RUN_ARGS] if devices else ["--network", "host"]
    if gpu is not None:
        options = ["--device", f"nvidia.com/gpu={gpu}", *options]
    script = _ARGS + (FABRIC_SCRIPT if devices else "") + (_IMPORTS if modules else "true")
    return [
        tool,
        "run",
        "--rm",
        "--pull=never",
        *options,
        "--entrypoint",
        "/bin/sh",
        image,
        "-c",
        script,
        "hgxserve-image-check",
        *devices,
        "--",
        *modules,
    ]


def imports_found(output: list[str]) -> dict[str, str]:
    """MODULE -> `ok` or what its import raised, from the check's output (`-`: no python3).

    >>> imports_found(["hgxserve-import: deep_ep ModuleNotFoundError: No module named 'deep_ep'"])
    {'deep_ep': "ModuleNotFoundError: No module named 'deep_ep'"}
    """
    found = {}
    for line in output:
        text = line.strip()
        if text.startswith(IMPORT_MARK):
            module, _, said = text[len(IMPORT_MARK) :].strip().partition(" ")
            found[module] = said.strip()
    return found


def _kernel_line(host: str, image: str, kernels: list[KernelImport], found: str, tail: str) -> str:
    want = ", ".join(f"{k.module} ({k.why})" for k in kernels)
    return f"{host}: container.kernels: expected {want} importable in {image}, found {found}{tail}"


def kernel_check_problems(
    host: str, image: str, kernels: tuple[KernelImport, ...], output: list[str]
) -> tuple[list[str], list[str]]:
    """(problems, warnings): one line for the required kernels that do not import in `image`,
    one for the advised ones; `output` is what image_check_argv printed."""
    found = imports_found(output)
    if not kernels:
        return [], []
    if not found:
        lines = [line.strip() for line in output if line.strip()]
        said = lines[-1] if lines else "no output"
        return [
            _kernel_line(host, image, list(kernels), "the check could not run: " + said, "")
        ], []
    if "-" in found:
        return [_kernel_line(host, image, list(kernels), "no python3 on the image's PATH", "")], []
    out: tuple[list[str], list[str]] = ([], [])
    for required, tail in (
        (True, ": the engine cannot start (build the image with them, or pin one that has them)"),
        (False, ": the engine runs on slower paths without them"),
    ):
        bad = [k for k in kernels if k.required is required and found.get(k.module) != "ok"]
        if bad:
            said = "; ".join(f"{k.module}: {found.get(k.module) or 'not tried'}" for k in bad)
            out[0 if required else 1].append(_kernel_line(host, image, bad, said, tail))
    return out


def image_check_problems(
    host: str, check: ImageCheck, devices: tuple[str, ...], output: list[str]
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one image's check: the fabric line, the kernels' lines; a check
    that could not run is said once."""
    problems: list[str] = []
    if check.fabric:
        line = fabric_check_problem(host, check.image, devices, output)
        problems += [line] if line else []
        ran = any(x.strip().startswith(FABRIC_MARK) for x in output)
        if not ran:
            return problems, []
    kernel_problems, warnings = kernel_check_problems(host, check.image, check.kernels, output)
    return problems + kernel_problems, warnings
