"""Container engines see the fabric: an engine whose KV or DP/EP crosses hosts, or that names
RDMA devices, runs with the host's /dev/infiniband, IPC_LOCK, unlimited memlock and the host's
IPC namespace (its /dev/shm); a preflight check runs the image the same way and says in one line
when the HCAs are not visible inside it, and in one line which kernel packages the engine needs
(hgxserve.topology.kernels) do not import with the image's python3."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hgxserve.facts.preflight import expectation_from_topology
from hgxserve.facts.runtime import ContainerImageCheck
from hgxserve.render import render_host
from hgxserve.runtime.fabric import (
    COMMON_RUN_ARGS,
    FABRIC_RUN_ARGS,
    fabric_check_problem,
    fabric_reasons,
)
from hgxserve.runtime.image_check import (
    ImageCheck,
    KernelImport,
    image_check_argv,
    image_check_problems,
    image_checks,
    kernel_check_problems,
)
from hgxserve.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
IMAGE = "vllm/vllm-openai@sha256:3c5c53248febaa72823a4b7e51aafa1cd2b65d860392e3930414da4d3864f541"
RAILS = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")


def _topo(rel: str):  # type: ignore[no-untyped-def]
    return load_topology(REPO / rel)


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv, argv[1:], strict=False))


@pytest.mark.parametrize(("host", "engine"), [("h20-a", "prefill-0"), ("h20-b", "decode-0")])
def test_cross_host_container_units_carry_the_fabric(host: str, engine: str) -> None:
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    assert "its KV transfer crosses hosts" in fabric_reasons(topo, topo.engines[engine], host)
    unit = render_host(topo, host).units[0]
    run = unit.argv[: unit.argv.index("--entrypoint")]
    pairs = _pairs(run)
    assert ("--device", "/dev/infiniband") in pairs
    assert ("--cap-add", "IPC_LOCK") in pairs
    assert ("--ulimit", "memlock=-1:-1") in pairs
    # the host's IPC namespace: its /dev/shm, sized by the host's shm setting, is the engine's
    assert ("--ipc", "host") in pairs
    assert not any(word.startswith("--shm-size") for word in run)
    assert "RDMA in the container (--device /dev/infiniband" in unit.content


def test_sglang_mooncake_containers_carry_the_fabric() -> None:
    topo = load_topology(REPO / "tests/render/topologies/sglang-pd-image.yml")
    for host in ("h20-a", "h20-b"):
        run = render_host(topo, host).units[0].argv
        assert ("--device", "/dev/infiniband") in _pairs(run)


def test_no_rdma_listed_means_no_devices_and_a_note() -> None:
    topo = load_topology(REPO / "tests/render/topologies/vllm-dp-two-nodes-docker.yml")
    engine = topo.engines["combined-0"]
    assert fabric_reasons(topo, engine, "h200-a") == []
    unit = render_host(topo, "h200-a").units[0]
    assert "/dev/infiniband" not in unit.argv and "IPC_LOCK" not in unit.argv
    assert "lists no rdma" in unit.content


def test_venv_engines_are_left_alone() -> None:
    topo = _topo("topologies/h200-dsv32-2p1d.yml")  # cross-host, RDMA, venv runtime
    assert all(
        fabric_reasons(topo, e, e.head) == [] for e in topo.engines.values()
    )  # nothing to hand over outside a container


def test_the_check_runs_the_image_as_the_engine_runs_without_pulling() -> None:
    argv = image_check_argv("/usr/bin/podman", IMAGE, RAILS)
    assert argv[:4] == ["/usr/bin/podman", "run", "--rm", "--pull=never"]
    i = argv.index(IMAGE)
    assert argv[i - 2 : i] == ["--entrypoint", "/bin/sh"]
    assert argv[-5:] == [*RAILS, "--"]
    # every run option of the check is one the rendered engine unit has
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    engine_run = _pairs(render_host(topo, "h20-a").units[0].argv)
    options = [*COMMON_RUN_ARGS, *FABRIC_RUN_ARGS]
    for flag, value in zip(options[::2], options[1::2], strict=True):
        assert (flag, value) in engine_run


def test_image_checks_list_each_image_once_with_its_tool() -> None:
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    (check,) = image_checks(topo, "h20-a")
    assert (check.image, check.tool, check.fabric) == (IMAGE, "podman", True)
    assert expectation_from_topology(topo, "h20-b").image_checks[0].image == IMAGE
    docker = load_topology(REPO / "tests/render/topologies/vllm-dp-two-nodes-docker.yml")
    assert image_checks(docker, "h200-a") == []
    assert expectation_from_topology(docker, "h200-a").image_checks == ()


def _run_check(tmp_path: Path, hcas: list[str], verbs: list[str], devices: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """The check's shell, with its two paths pointed at fake sysfs and /dev trees."""
    sys_dir, dev_dir = tmp_path / "sys", tmp_path / "dev"
    for base, names in ((sys_dir, hcas), (dev_dir, verbs)):
        base.mkdir(exist_ok=True)
        for name in names:
            (base / name).touch()
    argv = image_check_argv("/usr/bin/podman", IMAGE, devices)
    i = argv.index("-c")
    script = argv[i + 1].replace("/sys/class/infiniband", str(sys_dir))
    script = script.replace("/dev/infiniband", str(dev_dir))
    done = subprocess.run(
        ["sh", "-c", script, *argv[i + 2 :]], capture_output=True, text=True, check=True
    )
    return fabric_check_problem("h20-a", IMAGE, devices, done.stdout.splitlines())


def test_the_check_passes_when_every_rail_is_visible(tmp_path: Path) -> None:
    verbs = ["uverbs0", "uverbs1", "uverbs2", "uverbs3", "rdma_cm"]
    assert _run_check(tmp_path, list(RAILS), verbs, RAILS) is None


@pytest.mark.parametrize(
    ("hcas", "verbs", "found"),
    [
        ([], [], "found no HCA in /sys/class/infiniband"),
        (list(RAILS), ["rdma_cm"], "listed but no /dev/infiniband/uverbs* device passed in"),
        (["mlx5_0", "mlx5_1"], ["uverbs0", "uverbs1"], "without mlx5_2,mlx5_3"),
    ],
)
def test_the_check_says_what_is_missing_in_one_line(
    tmp_path: Path, hcas: list[str], verbs: list[str], found: str
) -> None:
    line = _run_check(tmp_path, hcas, verbs, RAILS)
    assert line is not None and "\n" not in line
    assert line.startswith("h20-a: container.fabric: expected RDMA HCAs mlx5_0,mlx5_1,mlx5_2")
    assert found in line
    assert "--device /dev/infiniband --cap-add IPC_LOCK" in line


def test_a_check_that_could_not_run_says_why() -> None:
    said = "Error: vllm/vllm-openai@sha256:3c5c: image not known"
    line = fabric_check_problem("h20-a", IMAGE, RAILS, [said])
    assert line is not None and line.endswith(f"found the check could not run: {said}")


def test_fact_command_never_fails_the_fact_and_keeps_the_lines() -> None:
    fact = ContainerImageCheck()
    command = fact.command(tool="/usr/bin/podman", image=IMAGE, devices=RAILS, modules=("deep_ep",))
    assert command.startswith("/usr/bin/podman run --rm --pull=never")
    assert command.endswith(" -- deep_ep 2>&1 || true")
    assert fact.process(["", "hgxserve-fabric: hcas=mlx5_0 ; uverbs=uverbs0 ; missing="]) == [
        "hgxserve-fabric: hcas=mlx5_0 ; uverbs=uverbs0 ; missing="
    ]


def test_preflight_runs_the_check_for_loaded_images_that_need_the_fabric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import roles.preflight as role

    asked: list[dict[str, object]] = []

    class FakeHost:
        def get_fact(self, cls: type, **kwargs: object) -> list[str]:
            assert cls is ContainerImageCheck
            asked.append(kwargs)
            return ["Error: crun: device /dev/infiniband: no such file or directory"]

    monkeypatch.setattr(role, "host", FakeHost())
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    expect = expectation_from_topology(topo, "h20-a")
    loaded = {IMAGE: {"tool": True, "digest": IMAGE.rpartition("@")[2]}}
    (line,), warnings = role.image_check_problems(expect, loaded)
    assert warnings == []
    assert asked == [
        {"tool": "/usr/bin/podman", "image": IMAGE, "devices": RAILS, "modules": (), "gpu": 0}
    ]
    assert line.startswith("h20-a: container.fabric: expected RDMA HCAs mlx5_0,mlx5_1,mlx5_2")
    assert line.endswith(
        "could not run: Error: crun: device /dev/infiniband: no such file or directory"
    )
    # an image that is not loaded is image_problems' line, and not run
    asked.clear()
    assert role.image_check_problems(expect, {IMAGE: {"tool": True, "digest": None}}) == ([], [])
    assert asked == []


# --- kernels: the modules KERNEL_RULES names, imported with the image's python3 -----------------

SIM = "localhost/hgxserve-sim/vllm@sha256:" + "b" * 64


def _deepep_topology(tmp_path: Path) -> Path:
    """The demo baseline with an image runtime and a deepep all-to-all backend (DeepEP required,
    NVSHMEM advised); the demo hosts list no rdma, so the fabric is not asked for."""
    text = (REPO / "topologies/demo/demo-baseline.yml").read_text()
    text = text.replace(
        "runtime: {venv: /opt/vllm-sim}", f"runtime: {{image: {SIM}, tool: podman}}"
    )
    text = text.replace(
        "    max_num_seqs: 8\n", "    max_num_seqs: 8\n    all2all_backend: deepep_low_latency\n"
    )
    path = tmp_path / "deepep-image.yml"
    path.write_text(text)
    return path


def test_an_image_engine_that_needs_kernels_gets_a_check_without_the_fabric(tmp_path: Path) -> None:
    topo = load_topology(_deepep_topology(tmp_path))
    (check,) = image_checks(topo, "hgx-a")
    assert (check.image, check.fabric, check.gpu, check.modules) == (
        SIM, False, 0, ("deep_ep", "nvidia.nvshmem"),
    )  # fmt: skip
    assert [k.required for k in check.kernels] == [True, False]
    assert image_checks(topo, "hgx-b") == []  # no engine there
    argv = image_check_argv("/usr/bin/podman", SIM, (), check.modules, check.gpu)
    assert argv[:6] == [
        "/usr/bin/podman",
        "run",
        "--rm",
        "--pull=never",
        "--device",
        "nvidia.com/gpu=0",
    ]
    assert "/dev/infiniband" not in argv and "IPC_LOCK" not in argv
    assert argv[6:8] == ["--network", "host"] and "--ulimit" not in argv
    assert argv[argv.index(SIM) - 2 : argv.index(SIM)] == ["--entrypoint", "/bin/sh"]
    assert argv[-3:] == ["--", "deep_ep", "nvidia.nvshmem"]


def _imports(modules: tuple[str, ...], devices: tuple[str, ...] = ()) -> list[str]:
    """What the check's shell prints here, with this machine's python3 as the image's."""
    argv = image_check_argv("/usr/bin/podman", SIM, devices, modules, 0)
    i = argv.index("-c")
    done = subprocess.run(["sh", *argv[i:]], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


DEEP_EP = KernelImport("deep_ep", "DeepEP for args.all2all_backend deepep_low_latency", True)
NVSHMEM = KernelImport(
    "nvidia.nvshmem", "NVSHMEM for args.all2all_backend deepep_low_latency", False
)


def test_a_missing_kernel_module_is_one_line_naming_host_image_and_module() -> None:
    output = _imports(("json", "deep_ep"))
    assert output == [
        "hgxserve-import: json ok",
        "hgxserve-import: deep_ep ModuleNotFoundError: No module named 'deep_ep'",
    ]
    json_ok = KernelImport("json", "FlashInfer for args.attention_backend FLASHINFER", True)
    problems, warnings = kernel_check_problems("hgx-a", SIM, (json_ok, DEEP_EP), output)
    assert warnings == []
    assert problems == [
        f"hgx-a: container.kernels: expected deep_ep (DeepEP for args.all2all_backend "
        f"deepep_low_latency) importable in {SIM}, found deep_ep: ModuleNotFoundError: No module "
        "named 'deep_ep': the engine cannot start (build the image with them, or pin one that "
        "has them)"
    ]


def test_kernels_all_present_say_nothing_and_an_advised_one_is_a_warning() -> None:
    present = (KernelImport("json", "a", True), KernelImport("importlib.util", "b", False))
    assert kernel_check_problems("hgx-a", SIM, present, _imports(("json", "importlib.util"))) == (
        [], [],
    )  # fmt: skip
    # NVSHMEM is advised: a warning, printed as the check prints it
    output = ["hgxserve-import: nvidia.nvshmem ModuleNotFoundError: No module named 'nvidia'"]
    problems, (warning,) = kernel_check_problems("hgx-a", SIM, (DEEP_EP, NVSHMEM), [
        "hgxserve-import: deep_ep ok", *output,
    ])  # fmt: skip
    assert problems == []
    assert warning.startswith("hgx-a: container.kernels: expected nvidia.nvshmem (NVSHMEM for")
    assert warning.endswith("found nvidia.nvshmem: ModuleNotFoundError: No module named "
                            "'nvidia': the engine runs on slower paths without them")  # fmt: skip


def test_no_python3_and_a_check_that_could_not_run_are_one_line_each() -> None:
    no_python = ["hgxserve-import: - no python3 on the image's PATH"]
    (line,), _ = kernel_check_problems("hgx-a", SIM, (DEEP_EP,), no_python)
    assert line.endswith(f"importable in {SIM}, found no python3 on the image's PATH")
    said = "Error: setting up CDI devices: unresolvable CDI devices nvidia.com/gpu=0"
    (line,), _ = kernel_check_problems("hgx-a", SIM, (DEEP_EP,), [said])
    assert line.endswith(f"found the check could not run: {said}")
    # with the fabric asked for too, a run that failed is said once (the fabric's line)
    both = ImageCheck(SIM, "podman", fabric=True, kernels=(DEEP_EP,), gpu=0)
    (line,), _ = image_check_problems("hgx-a", both, ("mlx5_0",), [said])
    assert line.startswith("hgx-a: container.fabric:") and line.endswith(said)


def test_fabric_and_kernels_in_one_run_give_one_line_each() -> None:
    both = ImageCheck(SIM, "podman", fabric=True, kernels=(DEEP_EP,), gpu=0)
    output = _imports(("deep_ep",), ("mlx5_0",))  # this machine lists no HCA
    assert output[0].startswith("hgxserve-fabric: hcas=;")
    fabric, kernels = image_check_problems("hgx-a", both, ("mlx5_0",), output)
    assert kernels == [] and len(fabric) == 2
    assert fabric[0].startswith("hgx-a: container.fabric: expected RDMA HCAs mlx5_0 visible")
    assert fabric[1].startswith("hgx-a: container.kernels: expected deep_ep (DeepEP")


def test_preflight_runs_the_check_for_an_image_that_needs_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import roles.preflight as role

    asked: list[dict[str, object]] = []
    printed = [
        "hgxserve-import: deep_ep ModuleNotFoundError: No module named 'deep_ep'",
        "hgxserve-import: nvidia.nvshmem ok",
    ]

    class FakeHost:
        def get_fact(self, cls: type, **kwargs: object) -> list[str]:
            asked.append(kwargs)
            return printed

    monkeypatch.setattr(role, "host", FakeHost())
    expect = expectation_from_topology(load_topology(_deepep_topology(tmp_path)), "hgx-a")
    loaded = {SIM: {"tool": True, "digest": SIM.rpartition("@")[2]}}
    (line,), warnings = role.image_check_problems(expect, loaded)
    assert warnings == []
    assert asked == [{"tool": "/usr/bin/podman", "image": SIM, "devices": (),
                      "modules": ("deep_ep", "nvidia.nvshmem"), "gpu": 0}]  # fmt: skip
    assert line.startswith("hgx-a: container.kernels: expected deep_ep (DeepEP for args.")
    assert f"importable in {SIM}, found deep_ep: ModuleNotFoundError" in line
