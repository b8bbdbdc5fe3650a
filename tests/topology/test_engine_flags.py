"""extra_args read as the engines' parsers read them (hgxserve.topology.engine_flags), and the
rules that use it: a refused flag has no other spelling that passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hgxserve.topology import check_topology
from hgxserve.topology.engine_args import ARG_FLAGS
from hgxserve.topology.engine_flags import FLAGS_FILE, known_flags, read_extra_args, resolve

REPO = Path(__file__).resolve().parents[2]


def test_the_flag_lists_name_their_source_and_hold_every_rendered_flag() -> None:
    data = json.loads(FLAGS_FILE.read_text())
    for engine in ("vllm", "sglang"):
        assert "sha256" in data["sources"][engine]
        flags = known_flags(engine)
        assert len(flags) > 250
        assert all(f.startswith("-") and " " not in f for f in flags)
        # every flag the renderers write for a typed arg is one the engine takes
        rendered = {a.flag(engine) for a in ARG_FLAGS.values()} - {None}
        assert rendered <= flags, sorted(rendered - flags)


@pytest.mark.parametrize(
    ("engine", "written", "flag"),
    [
        ("vllm", "--trust_remote_code", "--trust-remote-code"),
        ("vllm", "--trust-remote", "--trust-remote-code"),
        ("vllm", "--trust_remote", "--trust-remote-code"),
        ("vllm", "--worker-extension", "--worker-extension-cls"),
        ("vllm", "--worker_extension_c", "--worker-extension-cls"),
        ("vllm", "--tool_parser_plugin", "--tool-parser-plugin"),
        ("vllm", "--middle", "--middleware"),
        ("vllm", "--allowed_local_media", "--allowed-local-media-path"),
        ("vllm", "--log-config-f", "--log-config-file"),
        ("vllm", "-O3", "--optimization-level"),
        ("vllm", "-tp", "-tp"),
        ("sglang", "--enable-custom-logit", "--enable-custom-logit-processor"),
        ("sglang", "--custom_weight", "--custom-weight-loader"),
        ("sglang", "--tp", "--tp-size"),
    ],
)
def test_other_spellings_resolve_to_the_flag_the_engine_takes(
    engine: str, written: str, flag: str
) -> None:
    (found,) = read_extra_args(engine, [written])  # type: ignore[arg-type]
    assert found.flag == flag


def test_a_prefix_of_several_flags_and_an_unknown_flag_resolve_to_none() -> None:
    flag, candidates = resolve("vllm", "--enable")
    assert flag is None and len(candidates) > 1
    assert resolve("vllm", "--no-such-flag") == (None, ())
    assert resolve("vllm", "--") == (None, ())
    # an exact flag wins over the longer ones it is a prefix of (argparse does the same)
    assert resolve("vllm", "--model")[0] == "--model"


def test_values_dotted_keys_and_numbers() -> None:
    found = read_extra_args(
        "vllm",
        ["--seed", "-1", "--kv_transfer_config.kv_connector_module_path=m.C", "--port=1", "x"],
    )
    assert [(f.index, f.flag, f.value, f.subkey) for f in found] == [
        (0, "--seed", "-1", ""),
        (2, "--kv-transfer-config", "m.C", "kv_connector_module_path"),
        (3, "--port", "1", ""),
    ]


def _topology(extra_args: list[str], env: dict[str, str] | None = None, engine: str = "vllm"):
    doc = {
        "name": "spellings",
        "hosts": {"h-a": {"address": "10.0.0.11", "gpu": "H200"}},
        "model": {
            "name": "m",
            "served_name": "m",
            "path": "/models/m",
            "source": {"local": {"path": "/models/m"}},
        },
        "engines": {
            "combined-0": {
                "role": "combined",
                "engine": engine,
                "version": "0.15.0" if engine == "vllm" else "0.5.17",
                "runtime": {"venv": "/opt/engine"},
                "place": {"h-a": [0, 1]},
                "tp": 2,
                "port": 8100,
                "args": {"max_num_seqs": 8},
                "extra_args": extra_args,
                "env": env or {},
            }
        },
    }
    return yaml.safe_dump(doc)


def _rules(tmp_path: Path, text: str) -> set[str]:
    path = tmp_path / "t.yml"
    path.write_text(text)
    return {p.rule for p in check_topology(str(path)).problems if p.severity == "error"}


@pytest.mark.parametrize(
    ("extra_args", "rule"),
    [
        (["--trust_remote_code"], "extra-args-typed"),
        (["--trust-remote"], "extra-args-typed"),
        (["--tensor_parallel_size", "4"], "extra-args-typed"),
        (["--worker_extension_cls", "e.X"], "args-load-code"),
        (["--worker-ext", "e.X"], "args-load-code"),
        (["--tool_parser_plugin", "/srv/p.py"], "args-load-code"),
        (["--reasoning-parser-pl", "/srv/p.py"], "args-load-code"),
        (["--config", "/srv/more.yml"], "args-load-code"),
        (["--config=/srv/more.yml"], "args-load-code"),
        (["--speculative-config.model=/srv/x"], "args-load-code"),
        (["--logging_config.pylogging_config_file=/srv/l.json"], "args-load-code"),
        (["--log_config_file", "/srv/l.json"], "args-load-code"),
        (["--allowed-local-media-path", "/"], "args-load-code"),
        (["-cc.inductor_passes.post_grad_custom_post_pass=evil.p"], "args-load-code"),
        (["--ec-transfer-config", '{"ec_connector_module_path": "evil"}'], "args-load-code"),
        (["--compilation_config", '{"inductor_passes": {"x": "evil.p"}}'], "args-load-code"),
        (["--additional-config", '{"a": [{"worker_cls": "evil.W"}]}'], "args-load-code"),
        (["--api_key", "sk-1"], "secret-env"),
        (["--hf-tok", "hf_1"], "secret-env"),
        (["--enable"], "extra-args-known"),
        (["--frobnicate"], "extra-args-known"),
        (["--"], "extra-args-known"),
    ],
)
def test_hostile_extra_args_are_refused(tmp_path: Path, extra_args: list[str], rule: str) -> None:
    assert rule in _rules(tmp_path, _topology(extra_args))


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_LOGGING_CONFIG_PATH",
        "SGLANG_LOGGING_CONFIG_PATH",
        "VLLM_SERVER_DEV_MODE",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_NCCL_SO_PATH",
        "VLLM_CUDART_SO_PATH",
        "VLLM_RUST_FRONTEND_PATH",
        "SGLANG_TEST_SCRIPTED_RUNTIME_SYS_PATH_ENTRY",
        "SGLANG_NEW_LIB_SO_PATH",
        "NIXL_EXTRA_PLUGIN_DIR",
    ],
)
def test_variables_that_load_code_or_open_routes_are_refused(tmp_path: Path, name: str) -> None:
    assert "env-loads-code" in _rules(tmp_path, _topology([], {name: "1"}))


def test_sglang_spellings(tmp_path: Path) -> None:
    rules = _rules(
        tmp_path, _topology(["--enable-custom-logit", "--trust_remote"], engine="sglang")
    )
    assert {"args-load-code", "extra-args-typed", "extra-args-known"} <= rules


def test_full_flags_in_either_spelling_pass(tmp_path: Path) -> None:
    text = _topology(["--kv_cache_memory_bytes", "67108864", "-O3", "--seed", "-1"])
    assert _rules(tmp_path, text) == set()


def test_an_accepted_unknown_flag_passes(tmp_path: Path) -> None:
    doc = yaml.safe_load(_topology(["--flag-of-a-newer-vllm"]))
    doc["accept"] = {"$.engines.combined-0.extra_args[0]": "added in the next vLLM, reviewed"}
    assert _rules(tmp_path, yaml.safe_dump(doc)) == set()
