"""Container engines see the fabric: an engine whose KV or DP/EP crosses hosts, or that names
RDMA devices, runs with the host's /dev/infiniband, IPC_LOCK, unlimited memlock and the host's
IPC namespace (its /dev/shm); a preflight check runs the image the same way and says in one line
when the HCAs are not visible inside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hgxserve.facts.preflight import expectation_from_topology
from hgxserve.facts.runtime import ContainerFabric
from hgxserve.render import render_host
from hgxserve.runtime.fabric import (
    COMMON_RUN_ARGS,
    FABRIC_RUN_ARGS,
    fabric_check_argv,
    fabric_check_problem,
    fabric_images,
    fabric_reasons,
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
    argv = fabric_check_argv("/usr/bin/podman", IMAGE, RAILS)
    assert argv[:4] == ["/usr/bin/podman", "run", "--rm", "--pull=never"]
    i = argv.index(IMAGE)
    assert argv[i - 2 : i] == ["--entrypoint", "/bin/sh"]
    assert argv[-4:] == list(RAILS)
    # every run option of the check is one the rendered engine unit has
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    engine_run = _pairs(render_host(topo, "h20-a").units[0].argv)
    options = [*COMMON_RUN_ARGS, *FABRIC_RUN_ARGS]
    for flag, value in zip(options[::2], options[1::2], strict=True):
        assert (flag, value) in engine_run


def test_fabric_images_lists_each_image_once_with_its_tool() -> None:
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    assert fabric_images(topo, "h20-a") == [(IMAGE, "podman")]
    assert expectation_from_topology(topo, "h20-b").fabric_images == ((IMAGE, "podman"),)
    docker = load_topology(REPO / "tests/render/topologies/vllm-dp-two-nodes-docker.yml")
    assert fabric_images(docker, "h200-a") == []
    assert expectation_from_topology(docker, "h200-a").fabric_images == ()


def _run_check(tmp_path: Path, hcas: list[str], verbs: list[str], devices: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """The check's shell, with its two paths pointed at fake sysfs and /dev trees."""
    sys_dir, dev_dir = tmp_path / "sys", tmp_path / "dev"
    for base, names in ((sys_dir, hcas), (dev_dir, verbs)):
        base.mkdir(exist_ok=True)
        for name in names:
            (base / name).touch()
    argv = fabric_check_argv("/usr/bin/podman", IMAGE, devices)
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
    fact = ContainerFabric()
    command = fact.command(tool="/usr/bin/podman", image=IMAGE, devices=RAILS)
    assert command.startswith("/usr/bin/podman run --rm --pull=never")
    assert command.endswith(" 2>&1 || true")
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
            assert cls is ContainerFabric
            asked.append(kwargs)
            return ["Error: crun: device /dev/infiniband: no such file or directory"]

    monkeypatch.setattr(role, "host", FakeHost())
    topo = _topo("topologies/h20-v4flash-1p1d-2node.yml")
    expect = expectation_from_topology(topo, "h20-a")
    loaded = {IMAGE: {"tool": True, "digest": IMAGE.rpartition("@")[2]}}
    (line,) = role.fabric_problems(expect, loaded)
    assert asked == [{"tool": "/usr/bin/podman", "image": IMAGE, "devices": RAILS}]
    assert line.startswith("h20-a: container.fabric: expected RDMA HCAs mlx5_0,mlx5_1,mlx5_2")
    assert line.endswith(
        "could not run: Error: crun: device /dev/infiniband: no such file or directory"
    )
    # an image that is not loaded is image_problems' line, and not run
    asked.clear()
    assert role.fabric_problems(expect, {IMAGE: {"tool": True, "digest": None}}) == []
    assert asked == []
