"""Runtime specs from topologies, and the preflight lines for every runtime mismatch."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from hgxserve.runtime import checks, spec
from hgxserve.runtime.checks import runtime_problems
from hgxserve.runtime.spec import RuntimeSpecError, VenvRuntime, container_images, venv_runtimes
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
PD = REPO / "topologies/demo/demo-pd.yml"
SGLANG_PD = REPO / "tests/topology/valid/sglang-pd-mooncake.yml"


def test_doctests() -> None:
    assert doctest.testmod(spec).failed == 0
    assert doctest.testmod(checks).failed == 0


def test_pd_hosts_get_nixl_and_the_combined_host_does_not() -> None:
    topo = load_topology(PD)
    (prefill,) = venv_runtimes(topo, "hgx-a")
    assert prefill.requirements == ("vllm==0.26.0", "nixl==1.5.1")
    assert prefill.imports == ("nixl._api",)
    (combined,) = venv_runtimes(topo, "hgx-c")
    assert combined.requirements == ("vllm==0.26.0",) and combined.imports == ()


def test_sglang_mooncake_gets_the_transfer_engine() -> None:
    topo = load_topology(SGLANG_PD)
    runtimes = [r for h in topo.hosts for r in venv_runtimes(topo, h, require_version=False)]
    assert runtimes
    assert all("mooncake.engine" in r.imports for r in runtimes)
    assert all(r.why["mooncake.engine"] == "SGLang disaggregation over Mooncake" for r in runtimes)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.yml"
    path.write_text(text)
    return path


def test_problems_name_every_engine(tmp_path: Path) -> None:
    text = PD.read_text().replace("  version: 0.26.0", "", 1)
    text = text.replace(
        "    role: combined\n",
        "    role: combined\n    version: 0.25.0\n    runtime: {venv: /opt/vllm-sim, "
        "packages: [vllm==0.25.0]}\n",
    )
    # a package outside the kernel and transfer tables needs an accept (rule package-known)
    text += '\naccept:\n  "$.engines.combined-0.runtime.packages[0]": "the case under test"\n'
    topo = load_topology(_write(tmp_path, text))
    with pytest.raises(RuntimeSpecError) as err:
        venv_runtimes(topo, "hgx-a")
    assert str(err.value) == (
        "engine prefill-0: runtime.venv /opt/vllm-sim needs the engine `version` to install "
        "(e.g. version: 0.26.0)"
    )
    with pytest.raises(RuntimeSpecError, match="runtime.packages pins vllm==0.25.0; the engine"):
        venv_runtimes(topo, "hgx-c")


def test_packages_must_be_exact_pins(tmp_path: Path) -> None:
    from hgxserve.topology import TopologyError

    text = PD.read_text().replace(
        "runtime: {venv: /opt/vllm-sim}", "runtime: {venv: /opt/vllm-sim, packages: ['x>=1']}"
    )
    with pytest.raises(TopologyError, match=r"\$\.defaults\.runtime"):
        load_topology(_write(tmp_path, text))


SPEC = VenvRuntime(
    "/opt/v", "vllm", "0.26.0", ("nixl==1.5.1",), ("nixl._api",), {"nixl._api": "vLLM P/D"}
)
OK = {"present": True, "engine_version": "0.26.0", "imports": {"nixl._api": "ok"}, "ucx": "x"}
DRIVER = {"status": "ok", "driver_version": "570.158.01", "cuda_version": "12.8"}


@pytest.mark.parametrize(
    ("state", "will_install", "expected"),
    [
        (OK, False, []),
        ({"present": False}, True, []),
        (
            {"present": False},
            False,
            ["h: runtime /opt/v: expected vllm 0.26.0 installed, found no venv "
             "(install it with deploys/runtime.py)"],
        ),
        (
            {**OK, "imports": {"nixl._api": "ModuleNotFoundError: No module named 'nixl'"}},
            False,
            ["h: runtime.nixl: expected nixl._api importable in /opt/v (vLLM P/D), "
             "found ModuleNotFoundError: No module named 'nixl'"],
        ),
        ({**OK, "imports": {"nixl._api": "ModuleNotFoundError: x"}}, True, []),
        (
            {**OK, "engine_version": "0.25.1"},
            True,
            ["h: engine.version: expected vllm 0.26.0 in /opt/v, found 0.25.1 (a runtime venv "
             "is not changed in place: releases start from it; install 0.26.0 into its own "
             "runtime.venv)"],
        ),
        ({**OK, "engine_version": None}, False,
         ["h: engine.version: expected vllm 0.26.0 in /opt/v, found not installed"]),
        ({**OK, "ucx": None}, False,
         ["h: runtime.ucx: expected UCX (libucp) for NIXL in /opt/v or on the system, found none"]),
        ({**OK, "torch_version": "2.9.0+cu130", "torch_cuda": "13.0"}, False,
         ["h: runtime.cuda: expected CUDA <= 12.8 (driver 570.158.01) in /opt/v, found torch "
          "2.9.0+cu130 built for CUDA 13.0: CUDA 13.0 needs driver branch 580 or newer "
          "(>= 580.65.06)"]),
        ({**OK, "torch_version": "2.9.0", "torch_cuda": "12.9"}, False, []),
        ({"present": True, "error": "Segmentation fault"}, False,
         ["h: runtime /opt/v: expected a working Python, found Segmentation fault"]),
    ],
)  # fmt: skip
def test_runtime_problems(state: dict, will_install: bool, expected: list[str]) -> None:
    assert runtime_problems("h", [SPEC], {"/opt/v": state}, DRIVER,
                            will_install=will_install) == expected  # fmt: skip


def test_cuda_checked_against_the_driver_provision_installs() -> None:
    state = {**OK, "torch_version": "2.9.0+cu130", "torch_cuda": "13.0"}
    assert runtime_problems("h", [SPEC], {"/opt/v": state}, DRIVER,
                            planned_driver="580.95.05") == []  # fmt: skip
    old = {"status": "ok", "driver_version": "580.95.05", "cuda_version": "13.0"}
    (line,) = runtime_problems("h", [SPEC], {"/opt/v": state}, old, planned_driver="570.158.01")
    assert line.startswith(
        "h: runtime.cuda: expected CUDA <= 12.8 (driver 570.158.01, which this deploy installs)"
    )


def test_no_driver_no_cuda_verdict() -> None:
    state = {**OK, "torch_version": "2.9.0+cu130", "torch_cuda": "13.0"}
    assert runtime_problems("h", [SPEC], {"/opt/v": state}, {"status": "absent"}) == []


def test_container_images_of_a_host() -> None:
    topo = load_topology(REPO / "tests/render/topologies/sglang-pd-image.yml")
    images = {h: container_images(topo, h) for h in topo.hosts}
    assert any(images.values())
    assert all(tool in ("podman", "docker") for found in images.values() for _, tool in found)
    assert all("@sha256:" in image for found in images.values() for image, _ in found)


def test_declared_cuda_is_checked_when_the_venv_has_no_torch() -> None:
    spec = VenvRuntime("/opt/v", "sglang", "0.5.17", cuda="13.0")
    state = {"present": True, "engine_version": "0.5.17", "imports": {}}
    assert runtime_problems("h", [spec], {"/opt/v": state}, DRIVER) == [
        "h: runtime.cuda: expected CUDA <= 12.8 (driver 570.158.01) in /opt/v, found a runtime "
        "(runtime.cuda) built for CUDA 13.0: CUDA 13.0 needs driver branch 580 or newer "
        "(>= 580.65.06)"
    ]
