"""pyinfra facts about engine runtimes: what a venv holds, the driver's CUDA, the host's Python.

`VenvRuntimeState` runs the venv's own Python (so versions are the ones the engine imports):
the engine distribution's version, torch and the CUDA it was built for (read from
`torch/version.py`, without importing torch), every module that must import (NIXL, Mooncake),
whether UCX's `libucp` is there (in the venv, e.g. bundled by the nixl wheels, or on the
system), and the runtime stage's marker. `DriverCuda` reads the driver's highest supported CUDA
version from nvidia-smi's header line (`... Driver Version: 570.158.01  CUDA Version: 12.8`).

Example:
    >>> host.get_fact(VenvRuntimeState, venv="/opt/vllm-0.26", dist="vllm",
    ...               imports=("nixl._api",))["engine_version"]  # doctest: +SKIP
    '0.26.0'
"""

from __future__ import annotations

import shlex
from typing import Any

from hgxserve.base.paths import RUNTIME_MARKER
from hgxserve.facts.common import Fact
from hgxserve.parsers.probes import (
    driver_cuda_default,
    driver_cuda_from_lines,
    venv_state_from_lines,
)
from hgxserve.runtime.image_check import image_check_argv

# Runs inside the venv's Python; prints one JSON line. Standard library only.
PROBE = r"""
import importlib, importlib.metadata as md, importlib.util, json, os, re, sys, ctypes.util
dist, imports, marker = sys.argv[1], [m for m in sys.argv[2].split(",") if m], sys.argv[3]
out = {"python": "%d.%d.%d" % sys.version_info[:3], "imports": {}}
try:
    out["engine_version"] = md.version(dist)
    out["engine_summary"] = md.metadata(dist).get("Summary") or ""
except md.PackageNotFoundError:
    out["engine_version"] = None
try:
    out["torch_version"] = md.version("torch")
    spec = importlib.util.find_spec("torch")
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    found = re.search(r"^cuda\s*(?::\s*\S+\s*)?=\s*['\"]([0-9.]+)['\"]", open(path).read(), re.M)
    out["torch_cuda"] = found.group(1) if found else None
except Exception:
    out["torch_version"] = None
for module in imports:
    try:
        importlib.import_module(module)
        out["imports"][module] = "ok"
    except BaseException as exc:
        out["imports"][module] = ("%s: %s" % (type(exc).__name__, exc)).splitlines()[0][:300]
ucp = None
for top in sys.path:
    if not top.endswith("site-packages") or not os.path.isdir(top):
        continue
    for root, dirs, files in os.walk(top):
        hit = [f for f in files if f.startswith("libucp.so") or f.startswith("libucp-")]
        if hit:
            ucp = os.path.join(root, hit[0]); break
    if ucp:
        break
out["ucx"] = ucp or ctypes.util.find_library("ucp")
try:
    out["marker"] = json.load(open(marker))
except Exception:
    out["marker"] = None
print("##json " + json.dumps(out))
"""


class VenvRuntimeState(Fact):
    """A runtime venv as its own Python sees it (`present: False` when it has no Python).

    Example:
        >>> host.get_fact(VenvRuntimeState, venv="/opt/vllm-sim", dist="vllm", imports=())
        ... # doctest: +SKIP
        {'present': True, 'engine_version': '0.26.0+sim', 'torch_version': None, ...}
    """

    empty = {"present": False}

    def command(self, venv: str, dist: str, imports: tuple[str, ...] = ()) -> str:
        python = f"{venv.rstrip('/')}/bin/python"
        marker = f"{venv.rstrip('/')}/{RUNTIME_MARKER}"
        run = shlex.join([python, "-c", PROBE, dist, ",".join(imports), marker])
        return (
            f'if [ -x {shlex.quote(python)} ]; then {run} 2>&1; echo "##rc $?"; '
            "else echo '##absent'; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        return venv_state_from_lines(output)


class DriverCuda(Fact):
    """The driver version and the highest CUDA version it supports, from nvidia-smi's header.

    `status` is `ok`, `absent` (no nvidia-smi) or `error` (it ran and failed).

    Example:
        >>> host.get_fact(DriverCuda)  # doctest: +SKIP
        {'status': 'ok', 'driver_version': '570.158.01', 'cuda_version': '12.8'}
    """

    empty = driver_cuda_default()

    def command(self) -> str:
        return (
            "if command -v nvidia-smi >/dev/null 2>&1; then out=$(nvidia-smi 2>&1); rc=$?; "
            "printf '%s\\n' \"$out\" | head -n 8; echo \"##rc $rc\"; else echo '##absent'; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        return driver_cuda_from_lines(output)


class HostPython(Fact):
    """The host's python3 as pip sees platforms: version, machine, glibc (for wheel tags).

    Example:
        >>> host.get_fact(HostPython)  # doctest: +SKIP
        {'version': '3.11', 'machine': 'x86_64', 'glibc': '2.36'}
    """

    empty = {"version": None, "machine": None, "glibc": None}

    def command(self) -> str:
        return (
            "python3 -c 'import platform, sys; "
            'print("%d.%d" % sys.version_info[:2], platform.machine(), '
            'platform.libc_ver()[1] or "-")\' 2>/dev/null || echo absent'
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        words = " ".join(output).split()
        if len(words) != 3:
            return self.default()
        version, machine, glibc = words
        return {"version": version, "machine": machine, "glibc": None if glibc == "-" else glibc}


class CdiSpecState(Fact):
    """Whether the CDI spec exists and which driver version it was generated for (its stamp).

    Example:
        >>> host.get_fact(CdiSpecState, spec="/etc/cdi/nvidia.yaml",
        ...               stamp="/etc/cdi/.hgxserve-driver")  # doctest: +SKIP
        {'present': True, 'driver': '570.158.01'}
    """

    empty = {"present": False, "driver": None}

    def command(self, spec: str, stamp: str) -> str:
        return (
            f"if [ -s {shlex.quote(spec)} ]; then echo present; else echo absent; fi; "
            f"cat {shlex.quote(stamp)} 2>/dev/null || true"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        lines = [line.strip() for line in output if line.strip()]
        return {
            "present": bool(lines) and lines[0] == "present",
            "driver": lines[1] if len(lines) > 1 else None,
        }


class ContainerImage(Fact):
    """An image as the container tool knows it: its manifest digest, or absent.

    `tool` is None when the container tool itself is not installed.

    Example:
        >>> host.get_fact(ContainerImage, tool="/usr/bin/podman",
        ...               image="docker.io/vllm/vllm-openai@sha256:...")  # doctest: +SKIP
        {'tool': True, 'digest': 'sha256:...'}
    """

    empty = {"tool": False, "digest": None}

    def command(self, tool: str, image: str) -> str:
        inspect = shlex.join([tool, "image", "inspect", "--format", "{{.Digest}}", image])
        return (
            f"if [ -x {shlex.quote(tool)} ]; then echo tool; {inspect} 2>/dev/null || true; "
            "else echo notool; fi"
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        lines = [line.strip() for line in output if line.strip()]
        if not lines or lines[0] != "tool":
            return self.default()
        digest = next((line for line in lines[1:] if line.startswith("sha256:")), None)
        return {"tool": True, "digest": digest}


class ContainerImageCheck(Fact):
    """What an engine image sees when run as the engine runs (hgxserve.runtime.image_check):
    the output lines of `image_check_argv` (the HCAs it lists, which kernel modules its python3
    imports), for `image_check_problems` to judge. It runs the image with `--rm --pull=never`,
    so it changes nothing and needs the image already loaded.

    Example:
        >>> host.get_fact(ContainerImageCheck, tool="/usr/bin/podman", image="r/e@sha256:...",
        ...               devices=("mlx5_0",), modules=("deep_ep",), gpu=0)  # doctest: +SKIP
        ['hgxserve-fabric: hcas=mlx5_0 ; uverbs=uverbs0 ; missing=', 'hgxserve-import: deep_ep ok']
    """

    empty = []

    def command(
        self,
        tool: str,
        image: str,
        devices: tuple[str, ...] = (),
        modules: tuple[str, ...] = (),
        gpu: int | None = None,
    ) -> str:
        argv = image_check_argv(tool, image, tuple(devices), tuple(modules), gpu)
        return shlex.join(argv) + " 2>&1 || true"

    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line.strip()]
