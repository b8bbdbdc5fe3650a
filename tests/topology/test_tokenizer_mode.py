"""Rule tokenizer-mode: vLLM serving DeepSeek V3.2 / V4 runs the model's own tokenizer mode
(seed 002: every vLLM command passes --tokenizer-mode deepseek_v32; seed 003 §2.2, §5, §9.2:
deepseek_v4). The family is known by config.json's model_type, else by the model's names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hgxserve.topology import check_topology, load_topology
from hgxserve.topology.rules.vllm import deepseek_tokenizer_mode

REPO = Path(__file__).resolve().parents[2]

TOPOLOGY = """\
name: t
hosts:
  h-a: {{address: 10.0.0.11, gpu: H20}}
model:
  name: {name}
  served_name: served
  path: /models/checkpoint
  source: {{local: {{path: /models/checkpoint}}}}{config}
defaults:
  engine: {engine}
  version: {version}
  runtime: {{venv: /opt/e}}
  args: {{max_num_seqs: 8, max_model_len: 4096{args}}}
engines:
  combined-0: {{role: combined, place: {{h-a: [0, 1, 2, 3, 4, 5, 6, 7]}}, tp: 8, port: 8100}}
proxy:
  host: h-a
  combined: [combined-0]
"""


def _findings(tmp_path: Path, *, name: str = "m", engine: str = "vllm", mode: str = "",
              config: bool = False) -> list[str]:  # fmt: skip
    extra = ""
    if config:
        shutil.copy(REPO / "topologies/models/DeepSeek-V4-Flash-0731/config.json", tmp_path)
        extra = "\n  config: config.json"
    path = tmp_path / "t.yml"
    path.write_text(
        TOPOLOGY.format(
            name=name,
            config=extra,
            engine=engine,
            version="0.26.0" if engine == "vllm" else "0.5.17",
            args=f", tokenizer_mode: {mode}" if mode else "",
        )
    )
    return [p.message for p in check_topology(path).problems if p.rule == "tokenizer-mode"]


@pytest.mark.parametrize(
    ("name", "mode"),
    [("DeepSeek-V3.2", "deepseek_v32"), ("deepseek-v3.2-exp", "deepseek_v32"),
     ("DeepSeek-V4-Flash-0731", "deepseek_v4")],
)  # fmt: skip
def test_missing_mode_warns_and_the_right_one_passes(tmp_path: Path, name: str, mode: str) -> None:
    (message,) = _findings(tmp_path, name=name)
    assert f"set args.tokenizer_mode: {mode}" in message
    assert "seed 00" in message
    assert _findings(tmp_path, name=name, mode=mode) == []


def test_the_other_family_mode_is_a_finding(tmp_path: Path) -> None:
    (message,) = _findings(tmp_path, name="DeepSeek-V4-Flash", mode="deepseek_v32")
    assert "with tokenizer_mode deepseek_v32" in message
    assert "set args.tokenizer_mode: deepseek_v4" in message


def test_config_model_type_names_the_family_whatever_the_name(tmp_path: Path) -> None:
    (message,) = _findings(tmp_path, config=True)
    assert "model.config model_type deepseek_v4" in message


def test_not_deepseek_and_sglang_are_left_alone(tmp_path: Path) -> None:
    assert _findings(tmp_path, name="DeepSeek-V3") == []  # V3 has no such mode
    assert _findings(tmp_path, name="tiny-llama") == []
    assert _findings(tmp_path, name="DeepSeek-V3.2", engine="sglang") == []


def test_shipped_deepseek_topologies_are_recognised() -> None:
    for rel, mode in [
        ("topologies/h200-dsv32-tp8.yml", "deepseek_v32"),
        ("topologies/h20-v4flash-4p4d.yml", "deepseek_v4"),
    ]:
        found = deepseek_tokenizer_mode(load_topology(REPO / rel))
        assert found is not None and found[0] == mode
