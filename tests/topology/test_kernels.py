"""The kernel extras table (hgxserve.topology.kernels): each row fails where the model or args
select the kernel and the venv runtime lacks it, and passes once a pin or a wheel provides it;
the venv runtimes carry the wheels and import the kernels preflight checks."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from hgxserve.runtime.spec import venv_runtimes
from hgxserve.topology import check_topology, kernels, load_topology
from hgxserve.topology.model import RuntimeWheel

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "tests/topology/valid/kernel-wheels.yml"
GQA = "architecture: {attention: gqa}"
DSA = "architecture: {attention_heads: 128, kv_heads: 1, layers: 61, attention: dsa}"
TEMPLATE = """name: k
hosts:
  h-a: {address: 10.0.0.11, gpu: H200}
model:
  name: DeepSeek-V3.2
  served_name: DeepSeek-V3.2
  path: /models/DeepSeek-V3.2
  ARCH
  CONFIG
  source: {local: {path: /models/DeepSeek-V3.2}}
engines:
  e-0:
    role: combined
    engine: ENGINE
    version: 0.15.0
    runtime: {venv: /opt/e, packages: [PACKAGES]}
    place: {h-a: [0, 1, 2, 3, 4, 5, 6, 7]}
    tp: 8
    port: 8100
    args: ARGS
    extra_args: EXTRA
"""


def _topo(tmp_path: Path, **fields: str):
    text = TEMPLATE
    defaults = {"ARCH": DSA, "CONFIG": "", "ENGINE": "vllm", "PACKAGES": "", "ARGS": "{}"}
    for key, value in {**defaults, "EXTRA": "[]", **fields}.items():
        text = text.replace(key, value)
    path = tmp_path / "t.yml"
    path.write_text(text)
    topo = check_topology(path).topology  # the kernel rules' own errors are what is tested
    assert topo is not None
    return topo


def _needs(topo) -> dict[str, tuple[str, bool]]:
    engine = topo.engines["e-0"]
    return {
        n.rule.kernel: (n.rule.severity, n.declared) for n in kernels.kernel_needs(topo, engine)
    }


def test_doctests() -> None:
    assert doctest.testmod(kernels).failed == 0


DEEPEP = "{all2all_backend: deepep_low_latency}"
ROWS = [
    # (kernel, fields that select it, the package that provides it, severity)
    ("deepep", {"ARGS": DEEPEP}, "deep-ep==1.2.1", "error"),
    ("nvshmem", {"ARGS": DEEPEP}, "nvidia-nvshmem-cu12==3.3.20", "warning"),
    ("deepgemm", {"ENGINE": "sglang"}, "deep-gemm==2.1.1", "error"),
    ("deepgemm", {"ENGINE": "vllm"}, "deep-gemm==2.1.1", "warning"),
    (
        "deepgemm",
        {
            "ARCH": "architecture: {attention: mla}",
            "CONFIG": "config: " + str(REPO / "topologies/models/DeepSeek-V3.2/config.json"),
        },
        "deep-gemm==2.1.1",
        "warning",
    ),
]


@pytest.mark.parametrize(("kernel", "fields", "package", "severity"), ROWS)
def test_each_row_fails_without_and_passes_with_its_package(
    tmp_path: Path, kernel: str, fields: dict[str, str], package: str, severity: str
) -> None:
    assert _needs(_topo(tmp_path, **fields))[kernel] == (severity, False)
    assert _needs(_topo(tmp_path, PACKAGES=package, **fields))[kernel] == (severity, True)


def test_nothing_selected_nothing_needed(tmp_path: Path) -> None:
    topo = _topo(tmp_path, ARCH="architecture: {attention: gqa}")
    assert _needs(topo) == {}


@pytest.mark.parametrize(
    ("engine", "fields", "module"),
    [
        ("vllm", {"ARGS": "{attention_backend: FLASHINFER}", "ARCH": GQA}, "flashinfer"),
        ("sglang", {"ARGS": "{attention_backend: flashinfer}"}, "flashinfer"),
        ("vllm", {"ARGS": "{attention_backend: FLASHMLA_SPARSE}"}, "vllm._flashmla_C"),
        ("sglang", {"EXTRA": '["--nsa-decode-backend", "flashmla_kv"]'}, "sgl_kernel.flash_mla"),
    ],
)
def test_attention_backends_the_engine_carries_are_imported(
    tmp_path: Path, engine: str, fields: dict[str, str], module: str
) -> None:
    topo = _topo(tmp_path, ENGINE=engine, PACKAGES="deep-gemm==2.1.1", **fields)
    imports = dict(kernels.kernel_imports(topo, topo.engines["e-0"]))
    assert module in imports
    # a backend that selects neither imports nothing of them
    plain = _topo(tmp_path, ENGINE=engine, PACKAGES="deep-gemm==2.1.1")
    assert module not in dict(kernels.kernel_imports(plain, plain.engines["e-0"]))


def test_wheel_names_give_the_distribution() -> None:
    wheel = RuntimeWheel("a" * 64, url="s3://b/k/deep_ep-1.2.1-cp312-cp312-linux_x86_64.whl")
    assert (wheel.dist, wheel.version) == ("deep-ep", "1.2.1")
    assert RuntimeWheel("a" * 64, file="x.whl").dist == ""


def test_venv_runtime_carries_wheels_and_imports_their_kernels() -> None:
    topo = load_topology(WHEELS)
    (runtime,) = venv_runtimes(topo, "h-a")
    assert [(w.filename, w.url, w.path) for w in runtime.wheels] == [
        (
            "deep_ep-1.2.1-cp312-cp312-linux_x86_64.whl",
            "s3://wheels/deep_ep-1.2.1-cp312-cp312-linux_x86_64.whl",
            None,
        ),
        (
            "deep_gemm-2.1.1-cp312-cp312-linux_x86_64.whl",
            None,
            str(WHEELS.parent / "wheels/deep_gemm-2.1.1-cp312-cp312-linux_x86_64.whl"),
        ),
    ]
    assert runtime.requirements == ("vllm==0.15.0", "nvidia-nvshmem-cu12==3.3.20")
    assert set(runtime.imports) == {"deep_ep", "deep_gemm", "nvidia.nvshmem"}
    assert runtime.why["deep_ep"].startswith("DeepEP for args.all2all_backend")


def test_the_digest_names_the_wheels(tmp_path: Path) -> None:
    text = WHEELS.read_text()
    (before,) = venv_runtimes(load_topology(WHEELS), "h-a")
    path = tmp_path / "w.yml"
    path.write_text(text.replace("a" * 64, "c" * 64))
    (after,) = venv_runtimes(load_topology(path), "h-a")
    assert before.requirements == after.requirements
    assert before.digest != after.digest


def test_preflight_names_a_missing_kernel_in_one_line() -> None:
    from hgxserve.runtime.checks import runtime_problems

    topo = load_topology(WHEELS)
    (runtime,) = venv_runtimes(topo, "h-a")
    imports = {m: "ok" for m in runtime.imports}
    imports["deep_ep"] = "ModuleNotFoundError: No module named 'deep_ep'"
    state = {"present": True, "engine_version": "0.15.0", "imports": imports, "ucx": None}
    lines = runtime_problems("h-a", [runtime], {runtime.venv: state}, None)
    (line,) = [line for line in lines if "deep_ep" in line]
    assert "\n" not in line
    assert "DeepEP for args.all2all_backend deepep_high_throughput" in line
    assert "No module named 'deep_ep'" in line


def test_deepep_across_hosts_names_the_hosts_provision_sets_ibgda_on() -> None:
    two_p_one_d = load_topology(REPO / "topologies/h200-dsv32-2p1d.yml")
    assert kernels.deepep_across_hosts(two_p_one_d, "h200-a") == ["prefill-0"]
    assert kernels.deepep_across_hosts(two_p_one_d, "h200-f") == ["decode-0"]
    one_host = load_topology(WHEELS)  # DeepEP on one host: no IBGDA options
    assert kernels.deepep_across_hosts(one_host, "h-a") == []
