"""Checks run on a lent GPU machine (one H200): cache round trip and non-torch memory.

Runs with the machine's own Python (torch, triton) and the repository's `hgxserve` package:

    python3 scripts/device/h200_check.py jit OUT.json   # cold compile -> pack -> restore -> warm
    python3 scripts/device/h200_check.py mem OUT.json   # CUDA context, cuBLAS, NCCL, graph pools
    python3 scripts/device/h200_check.py hold GIB       # hold GIB of GPU memory until killed

`jit` answers whether a JIT cache baked on one host and restored with hgxserve's own archive code
(`hgxserve.caches.archive`) spares the next start its compiles: the same Triton kernel and
`torch.compile` model run cold in an empty key directory, the directory is packed, deleted and
restored at the same path, and the warm run's time and the files it adds are recorded (a run
that adds no compiled kernel did no JIT). A restore at another path shows whether the caches
depend on where they live.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())  # run from the repository root

WORKLOAD = r"""
import json, sys, time
t0 = time.monotonic()
import torch, triton, triton.language as tl

@triton.jit
def scaled_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha + y, mask=mask)

x = torch.randn(1 << 20, device="cuda"); y = torch.randn_like(x); out = torch.empty_like(x)
t1 = time.monotonic()
scaled_add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), 2.0, BLOCK=1024)
torch.cuda.synchronize()
t2 = time.monotonic()
assert torch.allclose(out, x * 2.0 + y)

class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d)
        self.up = torch.nn.Linear(d, 4 * d, bias=False)
        self.gate = torch.nn.Linear(d, 4 * d, bias=False)
        self.down = torch.nn.Linear(4 * d, d, bias=False)
    def forward(self, h):
        z = self.norm(h)
        return h + self.down(torch.nn.functional.silu(self.gate(z)) * self.up(z))

torch.manual_seed(0)
model = torch.nn.Sequential(*[Block(1024) for _ in range(4)]).cuda().to(torch.bfloat16)
compiled = torch.compile(model)
inp = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    got = compiled(inp)
    torch.cuda.synchronize()
    t3 = time.monotonic()
    ref = model(inp)
err = (got.float() - ref.float()).abs().max().item()
print(json.dumps({"import_s": t1 - t0, "triton_first_call_s": t2 - t1,
                  "compile_first_call_s": t3 - t2, "max_abs_err": err}))
"""


def _files(root: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for top, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(top, name)
            with contextlib.suppress(OSError):
                found[os.path.relpath(path, root)] = os.path.getsize(path)
    return found


def _run_workload(key_dir: str) -> dict[str, object]:
    from hgxserve.base.cachelayout import ENV_SUBDIRS

    env = dict(os.environ)
    for var, sub in ENV_SUBDIRS.items():
        env[var] = os.path.join(key_dir, sub)
        os.makedirs(env[var], exist_ok=True)
    before = _files(key_dir)
    # Triton reads a kernel's source with inspect: the workload must live in a file.
    script = os.path.join(os.path.dirname(key_dir), "workload.py")
    with open(script, "w") as fh:
        fh.write(WORKLOAD)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=600
    )
    wall = time.monotonic() - started
    after = _files(key_dir)
    added = sorted(set(after) - set(before))
    result: dict[str, object] = {
        "rc": proc.returncode,
        "wall_s": round(wall, 3),
        "files_before": len(before),
        "files_after": len(after),
        "added_files": len(added),
        "added_by_subdir": _count_by_subdir(added),
        "added_kernels": [p for p in added if p.endswith((".cubin", ".so", ".hsaco"))][:20],
    }
    if proc.returncode == 0:
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    else:
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def _count_by_subdir(paths: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        top = path.split(os.sep, 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return counts


def jit(out_path: str) -> None:
    import shutil

    from hgxserve.caches.archive import pack_dir, restore_archive

    work = tempfile.mkdtemp(prefix="hgx-jit-")
    key_dir = os.path.join(work, "root", "h200-key")
    other_dir = os.path.join(work, "elsewhere", "h200-key")
    os.makedirs(key_dir)
    report: dict[str, object] = {}
    report["cold"] = _run_workload(key_dir)
    report["warm_same_dir"] = _run_workload(key_dir)
    packed = pack_dir(key_dir, os.path.join(work, "archives"))
    report["pack"] = packed.as_dict()
    shutil.rmtree(key_dir)
    restored = restore_archive(packed.path, key_dir, sha256=packed.sha256)
    report["restore"] = restored.as_dict()
    report["warm_after_restore"] = _run_workload(key_dir)
    report["restore_elsewhere"] = restore_archive(packed.path, other_dir).as_dict()
    report["warm_restored_elsewhere"] = _run_workload(other_dir)
    report["cold_again"] = _run_workload(os.path.join(work, "empty", "h200-key"))
    with open(out_path, "w") as fh:
        json.dump(report, fh, indent=2)
    print(json.dumps({k: v.get("wall_s") for k, v in report.items() if isinstance(v, dict)}))


def mem(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    gib = float(1 << 30)
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    free0, total = torch.cuda.mem_get_info()
    report: dict[str, object] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "total_bytes": total,
        "total_gib": round(total / gib, 3),
        "used_after_context_gib": round((total - free0) / gib, 3),
    }

    def non_torch() -> float:
        free, _ = torch.cuda.mem_get_info()
        return round(((total - free) - torch.cuda.memory_reserved()) / gib, 3)

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.cuda.synchronize()
    report["non_torch_after_cublas_gib"] = non_torch()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    report["non_torch_after_nccl_gib"] = non_torch()
    reserved = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    static = torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (static @ w).sum()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = static @ w
    graph.replay()
    torch.cuda.synchronize()
    report["graph_pool_delta_gib"] = round((torch.cuda.memory_reserved() - reserved) / gib, 3)
    report["non_torch_after_graph_gib"] = non_torch()
    report["graph_output_shape"] = list(y.shape)
    dist.destroy_process_group()
    with open(out_path, "w") as fh:
        json.dump(report, fh, indent=2)
    print(json.dumps(report))


def hold(gib: str) -> None:
    import torch

    block = torch.empty(int(float(gib) * (1 << 30)), dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    print("holding", block.numel(), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    {"jit": jit, "mem": mem, "hold": hold}[sys.argv[1]](sys.argv[2])
