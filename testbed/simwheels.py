"""SIMULATED engine packages for the test hosts: wheels built from testbed/simengine.py.

The test hosts get their engine the way real hosts do: the runtime stage (deploys/runtime.py)
installs `vllm==<version>` / `sglang==<version>` and the P/D extras into the topology's venv from
a wheelhouse. These wheels stand in for the real distributions there. Every one is marked as
simulated three times over: the local version label `+sim`, the metadata Summary, and the code
(`vllm/__init__.py` says SIMULATED and `SIMULATED = True`). The engine wheels carry
testbed/simengine.py as `<engine>/simulated_engine.py` and a console script `vllm` / `sglang`
that runs it; `nixl` provides `nixl._api` and `mooncake-transfer-engine` `mooncake.engine`, as
the real ones do, and `deep-gemm` provides `deep_gemm` (what preflight imports), and nothing else
(no transfer happens through them: the simulated engine does its own KV "transfer" over its side
channel).

    python -m testbed.simwheels /var/lib/hgxserve-testbed/wheels     # build into a directory
"""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIMENGINE = REPO / "testbed" / "simengine.py"

# dist name -> (version, import package, summary); versions follow the seeds' engines.
ENGINES = {"vllm": "0.26.0+sim", "sglang": "0.5.6.post2+sim"}
EXTRAS = {
    "nixl": ("1.5.1+sim", "nixl", ("_api",)),
    "mooncake-transfer-engine": ("0.3.13.post1+sim", "mooncake", ("engine",)),
    # the kernel the shipped SGLang DeepSeek-V3.2 topology pins (kernel-required): importable,
    # nothing else, as preflight checks it
    "deep-gemm": ("2.1.1+sim", "deep_gemm", ()),
}
SUMMARY = "SIMULATED {what} for hgxserve test hosts: test equipment, not the real package"

ENGINE_INIT = '''"""SIMULATED {engine}: hgxserve test equipment, not the real engine (no GPU).

Installed on hgxserve test hosts by the runtime stage from a testbed-built wheel; the `{engine}`
command runs simulated_engine.py (a copy of testbed/simengine.py).
"""

import sys

SIMULATED = True
__version__ = "{version}"


def main() -> int:
    from {engine}.simulated_engine import main as run

    return run(["--engine", "{engine}", *sys.argv[1:]])
'''

EXTRA_MODULE = '''"""SIMULATED {dist} ({module}): hgxserve test equipment, not the real library.

Present so that the runtime's import check has something real to import on test hosts; it
transfers nothing.
"""

SIMULATED = True
__version__ = "{version}"
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(
    out: Path,
    dist: str,
    version: str,
    files: dict[str, bytes],
    summary: str,
    console: dict[str, str] | None = None,
) -> Path:
    """Write a pure-Python wheel (deterministic bytes) and return its path."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    meta = {
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\nSummary: {summary}\n"
            "Requires-Python: >=3.9\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: hgxserve-testbed\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    if console:
        lines = "".join(f"{name} = {target}\n" for name, target in sorted(console.items()))
        meta[f"{info}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()
    entries = {**files, **meta}
    record = [_record_line(name, data) for name, data in sorted(entries.items())]
    record.append(f"{info}/RECORD,,")
    entries[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = out / f"{norm}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in entries.items():
            item = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            item.external_attr = 0o644 << 16
            whl.writestr(item, data)
    if path.is_file() and path.read_bytes() == buf.getvalue():
        return path  # unchanged: keep its mtime, so wheelhouses built from it stay valid
    partial = path.with_suffix(".tmp")
    partial.write_bytes(buf.getvalue())
    partial.replace(path)
    return path


def build_all(out: Path) -> list[Path]:
    """Build every simulated wheel into `out` (replacing older builds); return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    built = []
    engine_code = SIMENGINE.read_bytes()
    for engine, version in ENGINES.items():
        init = ENGINE_INIT.format(engine=engine, version=version).encode()
        built.append(
            build_wheel(
                out,
                engine,
                version,
                {f"{engine}/__init__.py": init, f"{engine}/simulated_engine.py": engine_code},
                SUMMARY.format(what=f"{engine} engine"),
                console={engine: f"{engine}:main"},
            )
        )
    for dist, (version, package, modules) in EXTRAS.items():
        files = {
            f"{package}/__init__.py": EXTRA_MODULE.format(
                dist=dist, module=package, version=version
            ).encode()
        }
        for module in modules:
            files[f"{package}/{module}.py"] = EXTRA_MODULE.format(
                dist=dist, module=f"{package}.{module}", version=version
            ).encode()
        built.append(build_wheel(out, dist, version, files, SUMMARY.format(what=dist)))
    keep = {p.name for p in built}
    for old in out.glob("*.whl"):
        if old.name not in keep:
            old.unlink()
    return built


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("simwheels")
    for wheel in build_all(target):
        print(wheel)
