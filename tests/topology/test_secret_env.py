"""The `secret-env` rule: secret-looking env names are refused, token counts are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from hgxserve.topology import check_topology

REPO = Path(__file__).resolve().parents[2]
CASE = REPO / "tests" / "topology" / "invalid" / "secret-env.yml"
ENV_LINE = (
    "  env: {HF_TOKEN: hf_abcdefghijklmnopqrstuvwxyz012345, TOKENIZERS_PARALLELISM: 'false', "
    "HF_TOKEN_PATH: /etc/hgxserve/hf}\n"
)


def _env_errors(tmp_path: Path, name: str, value: str = "x1") -> list[str]:
    text = CASE.read_text()
    assert ENV_LINE in text
    text = text.replace(ENV_LINE, f"  env: {{{name}: '{value}'}}\n")
    text = text.replace("    extra_args: ['--api-key=changeme']\n", "")
    path = tmp_path / "t.yml"
    path.write_text(text)
    return [p.message for p in check_topology(path).errors if p.rule == "secret-env"]


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "AWS_SESSION_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "VLLM_API_KEY",
        "OPENAI_API_KEYS",  # seed 003 §10: OpenWebUI's key list
        "MY_API_KEY_VALUE",
        "GITHUB_TOKEN_B64",
        "HF_TOKEN_2",
        "API_KEY_PROD",
        "TOKEN",
        "DB_PASSWORD",
        "REDIS_PASSWD",
        "CEPH_SECRET",
        "S3_SECRET_KEY",
        "SERVICE_CREDENTIALS",
        "secret_for_x",
    ],
)
def test_secret_looking_names_are_still_refused(tmp_path: Path, name: str) -> None:
    (message,) = _env_errors(tmp_path, name)
    assert f"env {name} looks like a secret" in message


@pytest.mark.parametrize(
    "name",
    [
        # token counts and thresholds: vLLM's own variables (vllm/envs.py, 0.13 and 0.32)
        "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD",
        "VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD",
        "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE",
        "MY_KEY_SIZE",
        "PREFILL_TOKEN_BUDGET",
        "SIM_TOKEN_SECONDS",
        "STOP_TOKEN_IDS",
        "TOKENIZERS_PARALLELISM",
        # locations and ids, not the secret itself
        "HF_TOKEN_PATH",
        "AWS_ACCESS_KEY_ID",
        "API_KEY_FILE",
    ],
)
def test_token_counts_and_locations_are_not_secrets(tmp_path: Path, name: str) -> None:
    assert _env_errors(tmp_path, name, "512") == []


def test_an_empty_secret_name_is_not_refused(tmp_path: Path) -> None:
    """An empty value holds nothing to leak (it clears a variable the image sets)."""
    assert _env_errors(tmp_path, "HF_TOKEN", "") == []
